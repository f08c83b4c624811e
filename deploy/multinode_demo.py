"""`make multinode-demo`: a three-node Ray cluster on this machine (deploy/netns.py; needs root),
the prefill pool on node 0 and the decode pool spanning nodes 1 and 2, a few requests, where the
ranks are (`epcluster status`, the router's /sd/targets), then everything torn down."""

import json
import shlex
import sys
from pathlib import Path

from deploy.netns import Nodes, unavailable

EPCLUSTER = str(Path(sys.executable).with_name("epcluster"))
RESOURCES = [{"epcluster_prefill": 2}, {"epcluster_decode": 1}, {"epcluster_decode": 1}]


def demo(nodes: Nodes) -> None:
    for i, offers in enumerate(RESOURCES):
        print(f"node {i}: namespace {nodes.names[i]} at {nodes.addr(i)}, offers {offers}")
    config = {
        "model": "tiny",
        "ports": {"host": nodes.addr(0)},
        "security": {"allow_insecure_bind": True},  # the demo's private network namespaces
        "ray": {"ray_address": nodes.ray_address},
        "prefill": {"num_ranks": 2, "resources": {"epcluster_prefill": 1}},
        "decode": {"num_ranks": 2, "resources": {"epcluster_decode": 1}},
    }
    serve = nodes.serve(0, config, echo=True)
    target = f"{nodes.addr(0)}:50051"
    try:
        for cmd in (
            ["status", "--target", target],
            ["generate", "--target", target, "--prompt", "A class", "--max-tokens", "32"],
        ):
            print(f"$ epcluster {shlex.join(cmd)}   (from node 2)", flush=True)
            nodes.run(2, EPCLUSTER, *cmd, check=True, timeout=120)
        (targets,) = nodes.fetch(2, f"http://{nodes.addr(0)}:9400/sd/targets")
        print("metrics endpoints (the router's /sd/targets, read from node 2):")
        for group in json.loads(targets):
            print(f"  {group['targets'][0]:>18}  {group['labels']}")
    finally:
        print(f"epcluster serve stopped (exit status {serve.stop()})", flush=True)


def main() -> int:
    why = unavailable()
    if why is not None:
        print(f"multinode-demo: {why}", file=sys.stderr)
        return 2
    nodes = Nodes(RESOURCES)
    with nodes:
        demo(nodes)
    left = nodes.leftovers()
    print(f"torn down: namespaces, links, processes, files; left: {left or 'nothing'}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
