"""`make multinode-demo`: a three-node Ray cluster on this machine (deploy/netns.py; needs root),
the prefill pool on node 0 and the decode pool spanning nodes 1 and 2, a few requests, where the
ranks are (`epcluster status`, the router's /sd/targets), then everything torn down."""

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from deploy.netns import Nodes, unavailable

REPO = Path(__file__).resolve().parents[1]
EPCLUSTER = str(Path(sys.executable).with_name("epcluster"))


def main() -> int:
    why = unavailable()
    if why is not None:
        print(f"multinode-demo: {why}", file=sys.stderr)
        return 2
    resources = [{"epcluster_prefill": 2}, {"epcluster_decode": 1}, {"epcluster_decode": 1}]
    with Nodes(resources) as nodes, tempfile.TemporaryDirectory() as tmp:
        for i in range(3):
            print(f"node {i}: {nodes.names[i]} at {nodes.addr(i)}, offers {resources[i]}")
        config = {
            "model": "tiny",
            "host": nodes.addr(0),
            "ray_address": nodes.ray_address,
            "prefill": {"num_ranks": 2, "resources": {"epcluster_prefill": 1}},
            "decode": {"num_ranks": 2, "resources": {"epcluster_decode": 1}},
        }
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = nodes.popen(
            0, EPCLUSTER, "serve", "--config", str(path),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        end = time.monotonic() + 300
        for line in serve.stdout:
            print("  serve |", line.rstrip())
            if "epcluster: ready on" in line or time.monotonic() > end:
                break
        target = f"{nodes.addr(0)}:50051"
        try:
            for cmd in (
                ["status", "--target", target],
                ["generate", "--target", target, "--prompt", "A class", "--max-tokens", "32"],
            ):
                print(f"$ epcluster {' '.join(cmd)}   (from node 2)")
                nodes.run(2, EPCLUSTER, *cmd, check=True)
            with urllib.request.urlopen(f"http://{nodes.addr(0)}:9400/sd/targets") as r:
                print("metrics targets (the router's /sd/targets):")
                for group in json.load(r):
                    print(f"  {group['targets'][0]:>18}  {group['labels']}")
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(120)
    print("torn down: namespaces, links and Ray processes removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
