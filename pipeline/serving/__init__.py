"""Serving an exported package over HTTP (stage serve): the batching scheduler between requests and
the ONNX Runtime sessions (:mod:`.scheduler`), the Prometheus metrics (:mod:`.metrics`), the ASGI
app with its request guards and the uvicorn server that drains on SIGTERM (:mod:`.app`)."""
