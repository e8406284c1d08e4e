"""OpenAI-compatible HTTP gateway for VeriCache (a thin adapter over ``vericache.serving``)."""
