"""The HTTP/JSON front end: LibreTranslate-compatible and native (/v1/) routes, server-sent events,
health and the web page, served by uvicorn on the gRPC server's event loop. Every inference route
calls the gRPC servicer's own handlers (calls.py), so validation, limits, options, metrics and
status codes are the gRPC API's; only the wire format differs."""
