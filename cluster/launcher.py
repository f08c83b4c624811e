"""Cluster: Ray, the prefill and decode pools, and the gRPC router, started and stopped together."""

import asyncio
import contextlib
import glob
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import psutil
import ray
from ray._private import ray_constants

from cluster import registry
from cluster.attach import open_pools
from cluster.config import ClusterConfig
from cluster.config_sections import SecurityConfig
from cluster.pool import Pool
from engine.metrics.server import MetricsServer
from engine.model_info import build_model_info
from engine.tokenizer import load_tokenizer
from moe.config import ModelConfig
from moe.loader import resolve_model_path
from router.auth import ServerSecurity, read_token
from router.backends.cluster import ClusterBackend
from router.backends.prefix_index import IndexSize
from router.metrics import RouterMetrics
from router.server import RouterServer

log = logging.getLogger(__name__)


RAY_START_ATTEMPTS = 3
# A pool's start waits start_timeout_s for its placement (Pool.start says which pool lacks
# resources); forming it as a whole gets this much more, so that message is the one raised.
PLACEMENT_GRACE_S = 10.0


def _start_local_ray(num_cpus: int) -> None:
    """ray.init of a new local Ray on loopback. Ray gives its raylet a fixed 30 s to register
    with its GCS and raises when a loaded machine takes longer, leaving the processes it started
    running: those are killed and the start tried again (RAY_START_ATTEMPTS in all)."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace=registry.NAMESPACE,
                log_to_driver=False,
                configure_logging=False,
            )
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            log.warning(
                "Ray did not start (%s): attempt %d of %d", exc, attempt + 1, RAY_START_ATTEMPTS
            )
            with contextlib.suppress(Exception):
                ray.shutdown()
            _kill_new_children(before)


def _kill_new_children(before: set[int], wait_s: float = 10.0) -> None:
    """SIGKILL this process's descendants that are not in `before`, and reap them."""
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for proc in started:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(started, timeout=wait_s)


def chat_template(checkpoint: str | Path) -> str | None:
    """The checkpoint's chat template (tokenizer_config.json, as transformers reads it)."""
    config = Path(checkpoint) / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def server_security(s: SecurityConfig) -> ServerSecurity:
    """The router's ports' security from the config's files (router/auth.py)."""
    return ServerSecurity.from_files(
        s.auth_token_file, s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file, s.admin_token_file
    )


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.pools: dict[str, Pool] = {}
        self.server: RouterServer | None = None
        self.backend: ClusterBackend | None = None
        self.metrics: RouterMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.cluster_id = ""  # names the pools' rendezvous (files and stores)
        self.attached = False  # the pools ran before this router started (cluster/attach.py)
        self._owns_ray = False

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def start(self) -> "Cluster":
        """Start (or join) Ray, start both pools (or attach to the ones this cluster_name runs
        there), open the router; returns once both pools are ready and the health service says
        SERVING. Raises (after cleaning up what it started) on failure."""
        try:
            started = time.monotonic()
            self.start_ray()
            self.config = c = self.config.resolve_gpus(ray.cluster_resources().get("GPU", 0))
            path = resolve_model_path(c.model)  # presets are written before the ranks race
            mc = ModelConfig.from_file(path)
            prefill, decode = c.engine_config("prefill"), c.engine_config("decode")
            self.metrics = RouterMetrics(c.model)
            self.metrics.set_config(
                prefill_ranks=c.prefill.num_ranks,
                decode_ranks=c.decode.num_ranks,
                block_size=c.engine.block_size,
                kv_transport="p2p" if c.routing.kv_p2p else "object_store",
                two_batch_overlap=f"{prefill.two_batch_overlap}/{decode.two_batch_overlap}",
                dtype=c.dtype,
            )
            opened = open_pools(c)
            self.pools, self.cluster_id = opened.pools, opened.cluster_id
            self.attached = opened.attached
            self.backend = ClusterBackend(
                self.pools["prefill"].handles(),
                self.pools["decode"].handles(),
                build_model_info(c.model, mc, mc.max_position_embeddings, decode.torch_dtype),
                load_tokenizer(path, mc.vocab_size, mc.eos_token_id, mc.bos_token_id),
                c.engine.block_size,
                c.routing,
                c.health,
                control=self,
                metrics=self.metrics,
                prefix_index=IndexSize.of(
                    prefill.kv_cache_bytes,
                    mc.num_hidden_layers
                    * prefill.block_size
                    * mc.kv_cache_width
                    * prefill.torch_dtype.itemsize,
                    prefill.kv_tiers,
                ),
            )
            self._serve_metrics()
            # the protocols, mounted one by one: epcluster.v1 always, vLLM's engine protocol
            # for gateways, OpenAI HTTP when it has a port
            self.server = RouterServer(
                self.backend,
                c.ports.host,
                c.ports.port,
                admission=c.admission,
                ready_wait_s=c.routing.recovery_wait_s,
                metrics=self.metrics,
                security=server_security(c.security),
            )
            self.server.serve_vllm(c.model, path).start()
            if c.ports.http_port is not None:
                port = self.server.serve_http(
                    c.ports.http_port, c.model, self.metrics.registry, chat_template(path)
                )
                scheme = "http" if c.security.tls_cert_file is None else "https"
                log.info("OpenAI-compatible HTTP on %s://%s:%d/v1", scheme, c.ports.host, port)
            forming = self._start_pools(opened.to_form)
            self.server.call(asyncio.wait_for(forming, c.ray.start_timeout_s + PLACEMENT_GRACE_S))
            if not self.server.wait_ready(30):
                raise RuntimeError("the pools started but the router never became ready")
            how = "attached to the running pools" if self.attached else "started its pools"
            log.info("cluster ready in %.1f s (%s)", time.monotonic() - started, how)
            return self
        except BaseException:
            # NOTE: pools this router attached to stay (the next router may serve them); pools
            # it was starting go
            self.shutdown(remove_pools=None if self.attached else True)
            raise

    @property
    def http_address(self) -> str | None:
        """host:port of the OpenAI-compatible HTTP server, if it runs."""
        if self.server is None or self.server.http_port is None:
            return None
        return f"{self.config.ports.host}:{self.server.http_port}"

    def _serve_metrics(self) -> None:
        """The router's /metrics, and /sd/targets: Prometheus HTTP service discovery of every
        process (this router and each rank), so one scrape config finds them all."""
        c, backend = self.config, self.backend
        ports, security = c.ports, c.security
        if ports.metrics_port is None:
            return
        for pool in ("prefill", "decode"):
            self.metrics.child("epcluster_pool_ready", pool).set_function(
                lambda pool=pool: backend.pool_ready(pool)
            )
        try:
            self.metrics_server = MetricsServer(
                self.metrics.registry,
                ports.host,
                ports.metrics_port,
                tls=(
                    server_security(security).ssl_context(client_auth=False)
                    if security.metrics_tls
                    else None
                ),
                token=(
                    None
                    if security.metrics_token_file is None
                    else read_token(security.metrics_token_file)
                ),
            )
        except OSError as e:
            raise ValueError(
                f"ports.metrics_port {ports.metrics_port} on {ports.host} is taken ({e.strerror}; "
                "another epcluster?): set ports.metrics_port (--metrics-port) to a free port, 0 "
                "for any, or null to serve no /metrics"
            ) from e
        router = {"pool": "router", "model_name": c.model}
        if security.metrics_tls:  # Prometheus HTTP SD: scrape this target over https
            router["__scheme__"] = "https"
        self.metrics_server.routes["/sd/targets"] = lambda: [
            {"targets": [self.metrics_server.endpoint], "labels": router},
            *backend.sd_targets(),
        ]
        log.info(
            "metrics on %s://%s/metrics (discovery: /sd/targets)",
            self.metrics_server.scheme,
            self.metrics_server.endpoint,
        )

    async def _start_pools(self, names: list[str]) -> None:
        """Join the new actors of the pools `names` (all of them at a first start; none, or a
        broken one, when attaching); with p2p the others' ranks join the new KV group too."""
        kv_master = None
        if self.config.routing.kv_p2p and names:
            kv_master = await self.pools["prefill"].kv_master()
        others = [a for n, p in self.pools.items() if n not in names for a in p.actors]
        await asyncio.gather(
            *(self.pools[n].start(kv_master) for n in names),
            *(a.rejoin_kv.remote(kv_master) for a in others if kv_master is not None),
        )
        await self.backend.start()

    async def reform(self, name: str, placement: dict | None = None) -> list:
        """PoolControl: replace every rank of the pool `name` (the router calls this after one
        of them died or hung), loading the experts of `placement` (the pool's last known:
        live rebalances change it); -> the new rank handles. With the p2p KV transport, the
        other pool's ranks join the new KV group too."""
        pool = self.pools[name]
        if placement is not None:
            pool.placement = placement
        started = time.monotonic()
        # then Pools retries: a new generation
        wait = self.config.ray.start_timeout_s + PLACEMENT_GRACE_S
        if not self.config.routing.kv_p2p:
            await asyncio.wait_for(pool.reform(), wait)
        else:
            other = self.pools["decode" if name == "prefill" else "prefill"]
            kv_master = await other.kv_master()
            await asyncio.wait_for(
                asyncio.gather(
                    pool.reform(kv_master), *(a.rejoin_kv.remote(kv_master) for a in other.actors)
                ),
                wait,
            )
        log.info("%s pool re-formed in %.1f s", name, time.monotonic() - started)
        return pool.handles()

    async def rebuild_kv(self) -> None:
        """PoolControl: every rank of both pools joins a new p2p KV transport group."""
        kv_master = await self.pools["prefill"].kv_master()
        actors = [a for pool in self.pools.values() for a in pool.actors]
        await asyncio.gather(*(a.rejoin_kv.remote(kv_master) for a in actors))
        log.info("p2p KV transport group rebuilt (epoch %d)", kv_master.port)

    def start_ray(self) -> None:
        """Start a local Ray (or join config.ray_address); start() does this first."""
        if ray.is_initialized():
            return
        c = self.config
        if c.ray.ray_address is None:
            # NOTE: a local Ray listens on every interface unless told otherwise; a development
            # or test cluster stays on loopback. Ray reads this switch once, when it is
            # imported: the variable reaches the processes ray.init starts, and the constant
            # covers this process (ray.init turns "127.0.0.1" into the outside address
            # otherwise).
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
            ray_constants.ENABLE_RAY_CLUSTER = False
            ranks = c.prefill.num_ranks + c.decode.num_ranks
            # NOTE: address "local": with none, ray.init joins the cluster a `ray start` on
            # this machine last wrote to /tmp/ray/ray_current_cluster (even a dead one).
            _start_local_ray(num_cpus=max(os.cpu_count() or 1, ranks * c.ray.cpus_per_rank))
        else:
            ray.init(address=c.ray.ray_address, namespace=registry.NAMESPACE, log_to_driver=False)
        self._owns_ray = True

    def shutdown(self, drain_s: float | None = None, remove_pools: bool | None = None) -> None:
        """Drain the router (no new requests; in-flight streams get drain_s, by default the
        config's drain_timeout_s, to finish, then are aborted); remove the pools (kill the
        ranks, free the placement groups) when remove_pools, by default unless the config keeps
        them (keep_pools: by default on a joined Ray); stop Ray if this cluster started it.
        Idempotent."""
        if self.server is not None:
            grace = self.config.drain_timeout_s if drain_s is None else drain_s
            self.server.stop(grace, then=self.backend.close() if self.backend else None)
            self.server = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if remove_pools is None:
            remove_pools = not self.config.keeps_pools
        if self.pools and remove_pools:
            # every rank of the cluster stops (its KV tiers flush), then is killed
            log.info("removed: %s", ", ".join(registry.remove_pools(self.config.ray.cluster_name)))
            # the file stores of this cluster's groups (ranks killed by SIGKILL leave theirs)
            for path in glob.glob(f"{tempfile.gettempdir()}/epcluster-{self.cluster_id}-*"):
                with contextlib.suppress(OSError):
                    os.remove(path)
        elif self.pools:
            log.info(
                "the pools of cluster %r keep running (a router started on this Ray cluster "
                "attaches to them; `epcluster stop` removes them)",
                self.config.ray.cluster_name,
            )
        self.pools = {}
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
