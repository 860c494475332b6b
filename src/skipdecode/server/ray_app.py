"""Scale-out on Ray Serve: replicas that each run the engine behind the same routes.

Each replica builds the FastAPI app of ``app.py`` (one implementation of the
routes, not two) with its own model and engine; Ray Serve's HTTP proxy spreads
requests over replicas (power of two choices on ongoing requests) and, with
``autoscale``, adds or removes replicas on the ongoing requests per replica.
Every response names the replica that served it (``x-skipdecode-replica``,
and its process id in ``x-skipdecode-replica-pid``). A replica whose engine
loop died fails Ray's health check and is replaced; requests elsewhere go on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .app import ServerConfig, build_app


class _ReplicaHeaders:
    """ASGI middleware: adds the replica's id to every response (streams too)."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()
        self.pid = str(os.getpid()).encode()

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + [
                    (b"x-skipdecode-replica", self.replica), (b"x-skipdecode-replica-pid", self.pid)])
            await send(message)

        return await self.app(scope, receive, send_with_header)


class ReplicaLoadError(RuntimeError):
    """A replica could not load its model: Ray counts it as a failed start and,
    after its retries, marks the deployment failed."""


def replica_failure(message: str) -> str:
    """The line that says why, out of Ray's deployment-failure message (which
    carries the replica's traceback): our ``ReplicaLoadError`` if present."""
    lines = [x.strip() for x in message.splitlines() if x.strip()]
    ours = [x for x in lines if "ReplicaLoadError:" in x]
    if ours:
        return ours[-1].split("ReplicaLoadError:", 1)[1].strip()
    return lines[-1] if lines else message


def _deploy_failure(serve, error: RuntimeError) -> str:
    """Why the deployment failed: Ray's exception says only that it did; the
    deployment's status message carries the replica's exception."""
    why = str(error)
    try:
        app = serve.status().applications.get("skipdecode")
        why = "\n".join([why] + [d.message for d in (app.deployments.values() if app else ()) if d.message])
    except Exception:  # noqa: BLE001 - the status is a nicety; the exception's text is enough
        pass
    return replica_failure(why)


def check_replica(state) -> None:
    """Ray's health check of one replica (a ``ServerState``): raising marks it
    unhealthy and Ray replaces it."""
    if state.aengine is None or not state.aengine.alive:
        why = state.load_error or (state.aengine.error if state.aengine is not None else "not started")
        raise RuntimeError(f"skipdecode engine loop not alive: {why!r}")


def deployment(config: ServerConfig, num_replicas: int | None = 1, autoscale: tuple[int, int] | None = None,
               replica_cpus: float = 1.0):
    """The Ray Serve application: ``serve.run(deployment(...))``."""
    from ray import serve

    threads = max(1, int(replica_cpus))

    def build():  # runs on each replica
        import torch

        torch.set_num_threads(threads)
        ctx = serve.get_replica_context()
        rid = getattr(getattr(ctx, "replica_id", None), "unique_id", None) or getattr(ctx, "replica_tag", "?")
        app = build_app(config, load_in_background=False)
        state = app.state.skipdecode
        state.load()  # here, not in the app's start-up, so a failure fails the replica's start with its reason
        if state.load_error is not None:
            raise ReplicaLoadError(f"the model {config.model!r} failed to load: {state.load_error}")
        return _ReplicaHeaders(app, str(rid))

    opts = dict(ray_actor_options={"num_cpus": replica_cpus}, health_check_period_s=2, health_check_timeout_s=30,
                max_ongoing_requests=config.engine.max_num_seqs + config.max_queue,
                graceful_shutdown_wait_loop_s=1, graceful_shutdown_timeout_s=10)
    if autoscale is not None:
        lo, hi = autoscale
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                      "target_ongoing_requests": config.engine.max_num_seqs}
    else:
        opts["num_replicas"] = num_replicas

    @serve.deployment(name="skipdecode", **opts)
    @serve.ingress(build)
    class SkipdecodeReplica:
        def check_health(self) -> None:
            """Ray's health check: a replica whose engine loop stopped is replaced."""
            check_replica(self._asgi_app.state.skipdecode)

    return SkipdecodeReplica.bind()


def serve_on_ray(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                 num_replicas: int | None = 1, autoscale: tuple[int, int] | None = None,
                 replica_cpus: float = 1.0) -> int:
    """Start (or join, with ``ray_address``) a Ray cluster, deploy the replicas
    behind Ray Serve's HTTP proxy on ``host:port``, and serve until SIGTERM or
    SIGINT; then shut Serve down and return 0. A deployment whose replicas
    cannot start (a model that fails to load) returns 1 with the reason."""
    import ray
    from ray import serve

    if ray_address:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    else:
        # "local": a cluster of our own, never one that another process on this machine started
        ray.init(address="local", include_dashboard=False,
                 _node_ip_address=host if host in ("127.0.0.1", "localhost") else None, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port}, detached=False)
        try:
            serve.run(deployment(config, num_replicas, autoscale, replica_cpus), name="skipdecode",
                      route_prefix="/", blocking=False)
        except RuntimeError as e:  # Ray gave up after its retries: the deployment failed to start
            print(f"skipdecode: error: the Ray Serve replicas failed to start: {_deploy_failure(serve, e)}",
                  file=sys.stderr, flush=True)
            return 1
        print(f"skipdecode: serving on http://{host}:{port} through Ray Serve", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        stop.wait()
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
