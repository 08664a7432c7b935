"""Client-level differential privacy (docs/privacy.md): clipping, noise, adaptive clipping, accounting.

``privacy=central``: each client's update clipped to L2 norm C, Gaussian noise added once to the sum
on the server (``server.py``); ``privacy=local``: each client noises its own clipped update
(``clipping.py``). Epsilon comes from dp-accounting (``accounting.py``). ``setup.py`` checks a run's
config and builds the client and server halves for every runtime.

Only the algorithm-facing declarations are imported here, so the algorithm API can use them without
loading the accountant.
"""

from fl_platform.privacy.spec import PrivacyUnsupported, PrivateUploads

__all__ = ["PrivacyUnsupported", "PrivateUploads"]
