"""Bad cluster configs fail at start, before Ray starts, with a message that names the field:
wrong types, unknown fields, bad values, malformed YAML, a missing model or placement file; and
gpus_per_rank: null is decided by what the Ray cluster offers."""

import logging
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from cluster import launcher
from cluster.cli import build_parser as cli_parser
from cluster.cli import main, serve_overrides
from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from cluster.config_sections import SET_BY_CLUSTER

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"
FLAT = Path(__file__).resolve().parent / "data" / "flat_config.yaml"  # the previous release's

BAD_YAML = {
    "string port": ("ports: {port: '50051'}", "ports.port must be an integer (got str '50051')"),
    "bool timeout": ("drain_timeout_s: true", "drain_timeout_s must be a number (got bool True)"),
    "list model": ("model: [tiny]", "model must be a string"),
    "pool field type": ("prefill: {num_ranks: two}", "prefill.num_ranks must be an integer"),
    "resources type": (
        "decode: {resources: {epcluster_decode: one}}",
        "decode.resources must be a mapping of a string to a number",
    ),
    "pool not a mapping": ("decode: 4", "decode must be a mapping of pool fields"),
    "section not a mapping": ("routing: 4", "routing must be a mapping of routing fields"),
    "unknown field": ("prefil_ranks: 2", "unknown config field prefil_ranks"),
    "unknown pool field": ("prefill: {num_rank: 2}", "unknown config field prefill.num_rank"),
    "unknown section field": ("health: {stall_s: 2}", "unknown config field health.stall_s"),
    "unknown engine field": ("engine: {max_seqs: 2}", "unknown config field engine.max_seqs"),
    "engine model": ("engine: {model: tiny}", "engine.model is set at the top level (model)"),
    "pool engine device": ("decode: {engine: {device: cuda}}", "decode.engine.device follows ray"),
    "unknown pool engine field": (
        "decode: {engine: {max_seqs: 2}}",
        "unknown config field decode.engine.max_seqs",
    ),
    "pool engine type": (
        "decode: {engine: {max_num_seqs: many}}",
        "decode.engine.max_num_seqs must be an integer (got str 'many')",
    ),
    "port out of range": ("ports: {port: 70000}", "ports.port must be in [0, 65536) (got 70000)"),
    "negative timeout": ("health: {stall_timeout_s: -1}", "health.stall_timeout_s must be > 0"),
    "kv_p2p type": ("routing: {kv_p2p: p2p}", "routing.kv_p2p must be true or false"),
    "engine value": ("engine: {block_size: 0}", "engine.block_size must be >= 1 (got 0)"),
    "dtype": ("dtype: float64", "dtype must be one of"),
    "overlap": (
        "decode: {engine: {two_batch_overlap: maybe}}",
        "decode.engine.two_batch_overlap must be on, off or auto",
    ),
    "shared overlap": ("engine: {two_batch_overlap: maybe}", "engine.two_batch_overlap must be on"),
    "zero ranks": ("prefill: {num_ranks: 0}", "prefill.num_ranks must be >= 1"),
    "admission": ("admission: {max_queued_tokens: 0}", "admission.max_queued_tokens must be >= 1"),
    "routing": ("routing: {reserve_wait_s: 0}", "routing.reserve_wait_s must be > 0 (got 0)"),
    "cluster name": ("ray: {cluster_name: A_B}", "ray.cluster_name must be 1-40 lowercase"),
    "kv start vs lease": (
        "routing: {kv_lease_s: 30}\ncalls: {kv_start_timeout_s: 60}",
        "calls.kv_start_timeout_s must be more than 2 x routing.kv_lease_s",
    ),
    "keep pools on a local Ray": ("ray: {keep_pools: true}", "ray.keep_pools needs a Ray cluster"),
    "malformed YAML": ("ports: [1, 2", "is not valid YAML"),
    "not a mapping": ("- port: 1", "the config must be a mapping of fields, got list"),
    "missing model": ("model: /nowhere/ckpt", "model must be a preset"),
    "directory without config.json": ("model: /tmp", "no such directory or no config.json"),
    "missing token file": (
        "security: {auth_token_file: /nowhere/token}",
        "security.auth_token_file '/nowhere/token'",
    ),
    "cert without key": (
        "security: {tls_cert_file: /etc/hostname}",
        "security.tls_cert_file and security.tls_key_file go",
    ),
    "client CA without TLS": (
        "security: {tls_client_ca_file: /etc/hostname}",
        "needs TLS: set security.tls_cert",
    ),
    "public host, no token": (
        "ports: {host: 0.0.0.0}",
        "without authentication: set security.auth_token_file",
    ),
    "public IPv6, no token": ("ports: {host: '::'}", "or set security.allow_insecure_bind: true"),
    "metrics TLS without TLS": (
        "security: {metrics_tls: true}",
        "security.metrics_tls needs TLS: set security.tls_cert_file",
    ),
    "missing admin token file": (
        "security: {admin_token_file: /nowhere/a}",
        "security.admin_token_file '/nowhere/a'",
    ),
    "CUDA graphs on prefill": (
        "prefill: {engine: {cuda_graph: true}}",
        "prefill.engine.cuda_graph is for the decode pool: prefill ranks run no decode steps",
    ),
    "CUDA graphs for both pools": (
        "engine: {cuda_graph: true}",
        "engine.cuda_graph is for the decode pool: set decode.engine.cuda_graph",
    ),
    "CUDA graphs without GPUs": (
        "ray: {gpus_per_rank: 0}\ndecode: {engine: {cuda_graph: true}}",
        "decode.engine.cuda_graph needs GPUs: ray.gpus_per_rank is 0",
    ),
    "CUDA graph bucket": (
        "decode: {engine: {cuda_graph_max_batch: 0}}",
        "decode.engine.cuda_graph_max_batch must be >= 1 (got 0)",
    ),
    "missing placement file": (
        "prefill: {placement_file: /nowhere/placement.json}",
        "prefill.placement_file '/nowhere/placement.json' does not exist",
    ),
    # the old flat keys: moved into the tree, then checked there
    "old kv transport": ("kv_transport: tcp", "kv_transport must be object_store or p2p"),
    "old key and its new path": (
        "port: 1\nports: {port: 2}",
        "port (an old flat key) and ports.port are both set: keep ports.port",
    ),
    "old pool key checked at its path": (
        "decode: {max_num_seqs: 0}",
        "decode.engine.max_num_seqs must be >= 1 (got 0)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_YAML))
def test_bad_yaml_names_the_field(tmp_path, case):
    text, expected = BAD_YAML[case]
    path = tmp_path / "config.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(path)
    assert expected in str(err.value)


def test_a_missing_config_file():
    with pytest.raises(ConfigError, match="cannot read the config file /nowhere.yaml"):
        ClusterConfig.load("/nowhere.yaml")


def test_flags_are_checked_like_the_file():
    with pytest.raises(ConfigError, match="ports.port must be in"):
        ClusterConfig.load(None, {"ports.port": -1})
    with pytest.raises(ConfigError, match="model must be a preset"):
        ClusterConfig.load(None, {"model": "no-such-preset"})
    with pytest.raises(ConfigError, match="prefill.num_ranks must be >= 1"):
        ClusterConfig.load(None, {"prefill.num_ranks": 0})


def test_serve_with_a_bad_config_exits_2_naming_the_field(tmp_path, capsys, monkeypatch):
    def no_cluster(*args: object) -> None:
        raise AssertionError("a cluster was built from a bad config")

    monkeypatch.setattr(launcher, "Cluster", no_cluster)
    path = tmp_path / "config.yaml"
    path.write_text("decode: {engine: {max_num_seqs: 0}}\n")
    assert main(["serve", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "epcluster: decode.engine.max_num_seqs must be >= 1 (got 0)" in err
    assert "Traceback" not in err
    assert "starting" not in out


def test_the_serve_command_refuses_a_missing_model(tmp_path):
    """`epcluster serve` in a process of its own (the script runs cluster.cli:main): exit status
    2, the message on stderr, nothing started."""
    path = tmp_path / "config.yaml"
    path.write_text(f"model: {tmp_path / 'no-such-checkpoint'}\n")
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "model must be a preset (tiny, tiny-random, small) or a checkpoint directory" in (
        done.stderr
    )
    assert "no-such-checkpoint" in done.stderr and "Traceback" not in done.stderr
    assert "starting" not in done.stdout


def test_gpus_per_rank_null_follows_the_cluster():
    config = ClusterConfig.load(None)
    assert config.ray.gpus_per_rank is None
    cpu = config.resolve_gpus(0.0)
    assert cpu.ray.gpus_per_rank == 0.0 and cpu.engine_config("decode").device == "cpu"
    assert config.resolve_gpus(0.5).ray.gpus_per_rank == 0.0  # a fraction: not one per rank
    gpu = config.resolve_gpus(8.0)
    assert gpu.ray.gpus_per_rank == 1.0 and gpu.engine_config("prefill").device == "cuda"
    fixed = ClusterConfig.load(None, {"ray.gpus_per_rank": 0.5}).resolve_gpus(0.0)
    assert fixed.ray.gpus_per_rank == 0.5  # an explicit value is kept


def test_decode_cuda_graph_reaches_the_decode_engines_only_on_gpus():
    overrides = {"cuda_graph": True, "cuda_graph_max_batch": 16}
    config = ClusterConfig.from_dict({"decode": {"engine": overrides}})
    gpu = config.resolve_gpus(8.0)
    decode, prefill = gpu.engine_config("decode"), gpu.engine_config("prefill")
    assert (decode.device, decode.cuda_graph, decode.cuda_graph_max_batch) == ("cuda", True, 16)
    assert (prefill.device, prefill.cuda_graph) == ("cuda", False)
    with pytest.raises(ConfigError, match="decode.engine.cuda_graph needs GPUs and this Ray clu"):
        config.resolve_gpus(0.5)  # not a GPU per rank: the ranks would run on CPUs


def test_the_example_lists_every_field_with_its_default(caplog):
    """deploy/config.example.yaml: every field of every section, at its default, in the tree;
    it loads without a warning."""
    written = yaml.safe_load(EXAMPLE.read_text())
    expected = asdict(ClusterConfig())
    for name in SET_BY_CLUSTER:  # set at the top (model, dtype) or by the cluster (device)
        del expected["engine"][name]
    assert written == expected
    with caplog.at_level(logging.WARNING):
        assert ClusterConfig.load(EXAMPLE) == ClusterConfig()
    assert not caplog.records


def test_an_old_flat_config_loads_with_one_warning_to_the_same_values(caplog):
    """The previous release's example (every field, flat): the same values as the tree's, and
    one warning that names each old key with its new path."""
    with caplog.at_level(logging.WARNING):
        old = ClusterConfig.load(FLAT)
    (warning,) = caplog.records
    message = warning.getMessage()
    for moved in (
        "kv_transfer_timeout_s -> routing.kv_lease_s",
        "kv_transport -> routing.kv_p2p",
        "rank_stall_timeout_s -> health.stall_timeout_s",
        "collective_timeout_s -> ray.collective_timeout_s",
        "port -> ports.port",
        "decode.cuda_graph -> decode.engine.cuda_graph",
    ):
        assert moved in message
    flat = yaml.safe_load(FLAT.read_text())
    stay = {"model", "dtype", "drain_timeout_s", "prefill", "decode"}
    assert message.count(" -> ") == len(set(flat) - stay) + 2 * 5  # and 5 of each pool
    new = ClusterConfig()
    for section in ("engine", "routing", "health", "calls", "admission", "security", "ports"):
        assert getattr(old, section) == getattr(new, section), section
    assert old.ray == new.ray and old.drain_timeout_s == new.drain_timeout_s
    for pool in ("prefill", "decode"):
        assert old.engine_config(pool) == new.engine_config(pool)
        assert getattr(old, pool).num_ranks == getattr(new, pool).num_ranks


def test_old_flat_values_land_where_they_act():
    """Values other than the defaults, through the old keys: each reaches its new field."""
    old = ClusterConfig.from_dict(
        {
            "kv_transport": "p2p",
            "kv_transfer_timeout_s": 5.0,
            "kv_start_timeout_s": 11.0,
            "rank_stall_timeout_s": 4.0,
            "collective_timeout_s": 7.0,
            "port": 0,
            "decode": {"num_ranks": 3, "max_num_seqs": 8},
        }
    )
    assert (old.routing.kv_p2p, old.routing.kv_lease_s) == (True, 5.0)
    assert (old.calls.kv_start_timeout_s, old.health.stall_timeout_s) == (11.0, 4.0)
    assert (old.ray.collective_timeout_s, old.ports.port) == (7.0, 0)
    assert old.decode.num_ranks == 3 and old.engine_config("decode").max_num_seqs == 8
    assert old.engine_config("prefill").max_num_seqs == 64


def test_flags_land_on_the_tree_over_the_file(tmp_path):
    """`epcluster serve` flags set their dotted paths, over an old flat file too."""
    path = tmp_path / "config.yaml"
    path.write_text("port: 1234\nkv_transport: object_store\ndecode: {num_ranks: 3}\n")
    args = ["serve", "--config", str(path), "--port", "0", "--kv-transport", "p2p"]
    args += ["--prefill-ranks", "1", "--block-size", "32", "--drain-timeout", "5"]
    parsed = cli_parser().parse_args(args)
    config = ClusterConfig.load(parsed.config, serve_overrides(parsed))
    assert (config.ports.port, config.routing.kv_p2p, config.engine.block_size) == (0, True, 32)
    assert (config.prefill.num_ranks, config.decode.num_ranks) == (1, 3)
    assert config.drain_timeout_s == 5.0 and not config.security.allow_insecure_bind


def test_a_pool_overrides_the_shared_engine():
    config = ClusterConfig.from_dict(
        {"engine": {"max_num_seqs": 32}, "prefill": {"engine": {"max_num_batched_tokens": 8192}}}
    )
    prefill, decode = config.engine_config("prefill"), config.engine_config("decode")
    assert (prefill.max_num_seqs, prefill.max_num_batched_tokens) == (32, 8192)
    assert (decode.max_num_seqs, decode.max_num_batched_tokens) == (32, 2048)
    assert config.engine.model == prefill.model == config.model
