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


def test_tool_calls_on_a_killed_edge_are_rerun(dsec):
    """Default run: an edge SIGKILLed (by its owner) under a pooled sandbox and under a command in
    flight; both calls come back 'rerun' with the command's real output, from a fresh sandbox on the
    edge's next incarnation. Inverse control: the same calls on a live edge come back 'ran'."""
    import threading
    import time

    from v4stack.rl.sandboxes import ToolRunner

    tools = ToolRunner(dsec.url, dsec.token, slots=2)
    try:
        a, sid_a, seq_a = tools.reserve()
        b, sid_b, seq_b = tools.reserve()
        assert sid_a != sid_b
        assert tools.run(a, seq_a, "expr 40 + 2") == ("42\n", "ran")  # inverse control: live edge
        assert tools.run(b, seq_b, "echo live") == ("live\n", "ran")
        pooled, sid2, seq = tools.reserve()  # both from the pool, on the current edge
        slow, slow_id2, slow_seq = tools.reserve()
        assert {sid2, slow_id2} == {sid_a, sid_b}
        got = {}
        t = threading.Thread(target=lambda: got.update(slow=tools.run(slow, slow_seq, "sleep 1.5; echo late")))
        t.start()
        time.sleep(0.5)  # the command is running on the edge
        dead = dsec.kill_edge("edge-0")
        new = dsec.ensure_edge("edge-0")
        t.join(60)
        assert got["slow"] == ("late\n", "rerun")
        assert tools.run(pooled, seq, "expr 40 + 2") == ("42\n", "rerun")
        assert tools.stats.retried == 2 and tools.stats.failed == 0
        assert new["id"] != dead["id"] and new["registered"]
        fresh, fid, fseq = tools.reserve()  # the re-runs' sandboxes, on the new incarnation: 'ran'
        assert fid not in (sid2, slow_id2) and tools.run(fresh, fseq, "echo ok") == ("ok\n", "ran")
    finally:
        tools.close()
