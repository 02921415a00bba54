"""Sandbox edges owned by Ray actors on another Ray node than the driver (a two-node Ray cluster on
this machine): placement by a custom resource, the edge bound to its node's address, a command run
through the apiserver on it, and kill / ensure (a new incarnation)."""

from __future__ import annotations

import pytest

from tests.rl.conftest import dsec_missing


@pytest.mark.slow
def test_edge_actors_run_on_the_node_with_the_sandbox_resource(tmp_path):
    ray = pytest.importorskip("ray")
    if dsec_missing():
        pytest.skip(dsec_missing())
    from ray.cluster_utils import Cluster

    from v4stack.dsec.client import Sandbox
    from v4stack.rl.edges import node_address
    from v4stack.rl.fleet import init_ray
    from v4stack.rl.sandboxes import LocalDsec

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    sandbox_node = cluster.add_node(num_cpus=1, resources={"sandbox": 4})
    dsec = None
    try:
        init_ray(cluster.address, 1)
        driver_node = ray.get_runtime_context().get_node_id()
        dsec = LocalDsec(tmp_path / "dsec", edges=2, host=node_address(), ray_edges=True, edge_resource="sandbox")
        assert not dsec.url.startswith("http://127.")
        for name in dsec.edges.names:
            assert dsec.edges.call(name, "node") == sandbox_node.node_id != driver_node
            h = dsec.edges.call(name, "health")
            assert h["alive"] and h["serving"] and h["registered"] and not h["url"].startswith("http://127.")
        sbx = Sandbox.create(substrate="process", api_url=dsec.url, token=dsec.token)
        assert sbx.commands.run(["sh", "-c", "expr 40 + 2"], timeout=30).stdout.strip() == "42"
        dead = dsec.kill_edge("edge-0")
        assert not dsec.edges.call("edge-0", "health")["alive"]
        again = dsec.ensure_edge("edge-0")
        assert again["registered"] and again["id"] != dead["id"] and again["incarnation"] == 2
    finally:
        if dsec is not None:
            dsec.close()
        ray.shutdown()
        cluster.shutdown()
