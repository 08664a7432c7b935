"""A plug-in package outside fl_platform, for tests: a model, a data loader and an algorithm.

Imported as ``plugin_pkg`` with tests/ on ``sys.path`` (tests/test_plugins.py), the way a user's
own package is: the platform reaches it only through ``_target_`` references, ``algorithm=plugin``
and the ``fl_platform.algorithms`` entry-point group, never by an edit of its own registries.
"""
