"""``skipdecode serve``: an OpenAI-compatible HTTP server on the engine."""

from __future__ import annotations

from .app import ServerConfig, build_app


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0,
          log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM; on either, stop accepting connections, let
    requests in flight finish for up to ``grace`` seconds, then exit 0."""
    import signal

    import uvicorn

    # uvicorn drains on SIGTERM, then re-raises it to the handler it found; this
    # one lets the drained process exit 0 (a clean stop) instead of dying of it.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(build_app(config), host=host, port=port, timeout_graceful_shutdown=grace, log_level=log_level)


__all__ = ["ServerConfig", "build_app", "serve"]
