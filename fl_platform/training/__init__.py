"""The local training loop, its hooks, flat-parameter model views and optimisers."""
