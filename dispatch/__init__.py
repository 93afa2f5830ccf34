"""Routing and token dispatchers (import as ``moe_fold.dispatch``)."""
