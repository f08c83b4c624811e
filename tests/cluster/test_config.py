"""Bad cluster configs fail at start, before Ray starts, with a message that names the field:
wrong types, unknown fields, bad values, malformed YAML, a missing model or placement file; and
gpus_per_rank: null is decided by what the Ray cluster offers."""

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from cluster import launcher
from cluster.cli import main
from cluster.config import ClusterConfig, ConfigError

BAD_YAML = {
    "string port": ("port: '50051'", "port must be an integer (got str '50051')"),
    "bool timeout": ("drain_timeout_s: true", "drain_timeout_s must be a number (got bool True)"),
    "list model": ("model: [tiny]", "model must be a string"),
    "pool field type": ("prefill: {num_ranks: two}", "prefill.num_ranks must be an integer"),
    "resources type": (
        "decode: {resources: {epcluster_decode: one}}",
        "decode.resources must be a mapping of a string to a number",
    ),
    "pool not a mapping": ("decode: 4", "decode must be a mapping of pool fields"),
    "unknown field": ("prefil_ranks: 2", "unknown config field prefil_ranks"),
    "unknown pool field": ("prefill: {num_rank: 2}", "unknown config field prefill.num_rank"),
    "port out of range": ("port: 70000", "port must be in [0, 65536) (got 70000)"),
    "negative timeout": ("rank_stall_timeout_s: -1", "rank_stall_timeout_s must be > 0"),
    "kv transport": ("kv_transport: tcp", "kv_transport must be object_store or p2p"),
    "overlap": ("decode: {two_batch_overlap: maybe}", "decode.two_batch_overlap must be on, off"),
    "zero ranks": ("prefill: {num_ranks: 0}", "prefill.num_ranks must be >= 1"),
    "malformed YAML": ("port: [1, 2", "is not valid YAML"),
    "not a mapping": ("- port: 1", "the config must be a mapping of fields, got list"),
    "missing model": ("model: /nowhere/ckpt", "model must be a preset"),
    "directory without config.json": ("model: /tmp", "no such directory or no config.json"),
    "missing token file": ("auth_token_file: /nowhere/token", "auth_token_file '/nowhere/token'"),
    "cert without key": ("tls_cert_file: /etc/hostname", "tls_cert_file and tls_key_file go"),
    "client CA without TLS": ("tls_client_ca_file: /etc/hostname", "needs TLS: set tls_cert"),
    "public host, no token": ("host: 0.0.0.0", "without authentication: set auth_token_file"),
    "public IPv6, no token": ("host: '::'", "or set allow_insecure_bind: true"),
    "metrics TLS without TLS": ("metrics_tls: true", "metrics_tls needs TLS: set tls_cert_file"),
    "missing admin token file": ("admin_token_file: /nowhere/a", "admin_token_file '/nowhere/a'"),
    "CUDA graphs on prefill": (
        "prefill: {cuda_graph: true}",
        "prefill.cuda_graph is for the decode pool: prefill ranks run no decode steps",
    ),
    "CUDA graphs without GPUs": (
        "gpus_per_rank: 0\ndecode: {cuda_graph: true}",
        "decode.cuda_graph needs GPUs: gpus_per_rank is 0",
    ),
    "CUDA graph bucket": (
        "decode: {cuda_graph_max_batch: 0}",
        "decode.cuda_graph_max_batch must be >= 1 (got 0)",
    ),
    "missing placement file": (
        "prefill: {placement_file: /nowhere/placement.json}",
        "prefill.placement_file '/nowhere/placement.json' does not exist",
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
    with pytest.raises(ConfigError, match="port must be in"):
        ClusterConfig.load(None, port=-1)
    with pytest.raises(ConfigError, match="model must be a preset"):
        ClusterConfig.load(None, model="no-such-preset")
    with pytest.raises(ConfigError, match="prefill.num_ranks must be >= 1"):
        ClusterConfig.load(None, prefill_ranks=0)


def test_serve_with_a_bad_config_exits_2_naming_the_field(tmp_path, capsys, monkeypatch):
    def no_cluster(*args: object) -> None:
        raise AssertionError("a cluster was built from a bad config")

    monkeypatch.setattr(launcher, "Cluster", no_cluster)
    path = tmp_path / "config.yaml"
    path.write_text("decode: {max_num_seqs: 0}\n")
    assert main(["serve", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "epcluster: decode.max_num_seqs must be >= 1 (got 0)" in err
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
    assert config.gpus_per_rank is None
    cpu = config.resolve_gpus(0.0)
    assert cpu.gpus_per_rank == 0.0 and cpu.engine_config("decode").device == "cpu"
    assert config.resolve_gpus(0.5).gpus_per_rank == 0.0  # a fraction of a GPU: not one per rank
    gpu = config.resolve_gpus(8.0)
    assert gpu.gpus_per_rank == 1.0 and gpu.engine_config("prefill").device == "cuda"
    fixed = ClusterConfig.load(None, gpus_per_rank=0.5).resolve_gpus(0.0)
    assert fixed.gpus_per_rank == 0.5  # an explicit value is kept


def test_decode_cuda_graph_reaches_the_decode_engines_only_on_gpus():
    config = ClusterConfig.from_dict({"decode": {"cuda_graph": True, "cuda_graph_max_batch": 16}})
    gpu = config.resolve_gpus(8.0)
    decode, prefill = gpu.engine_config("decode"), gpu.engine_config("prefill")
    assert (decode.device, decode.cuda_graph, decode.cuda_graph_max_batch) == ("cuda", True, 16)
    assert (prefill.device, prefill.cuda_graph) == ("cuda", False)
    with pytest.raises(ConfigError, match="this Ray cluster offers 0.5: turn decode.cuda_graph"):
        config.resolve_gpus(0.5)  # not a GPU per rank: the ranks would run on CPUs


def test_the_example_lists_every_field_with_its_default():
    example = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"
    written = yaml.safe_load(example.read_text())
    assert written == asdict(ClusterConfig())
