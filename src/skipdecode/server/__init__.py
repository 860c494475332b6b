"""``skipdecode serve``: an OpenAI-compatible HTTP server on the engine."""

from __future__ import annotations

from .app import ServerConfig, build_app


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0,
          log_level: str = "info") -> int:
    """Run until SIGINT/SIGTERM; on either, stop accepting connections, let
    requests in flight finish for up to ``grace`` seconds, then return 0. A
    model that fails to load is logged and the server stops at once: returns 1."""
    import logging
    import signal

    import uvicorn

    logger = logging.getLogger("skipdecode")
    if not logger.handlers:  # the start-up, stats and warning lines, beside uvicorn's
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(log_level.upper())
    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace,
                                          log_level=log_level))
    state = app.state.skipdecode
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn drains on SIGTERM, then re-raises it to the handler it found; this
    # one lets the drained process exit 0 (a clean stop) instead of dying of it.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 1 if state.load_error else 0


__all__ = ["ServerConfig", "build_app", "serve"]
