"""The local multi-node cluster's layout (no broker needed): ports and cluster id chosen once
and kept, one data dir and one static voter per node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from snapline.connectors.local.broker import TEMP_DIR_PREFIX, _sweep_orphaned_data_dirs
from snapline.connectors.local.cluster import CLUSTER_FILE_NAME, LocalKafkaCluster
from snapline.pipeline.errors import BrokerError


def test_layout_is_chosen_once_and_kept(tmp_path: Path) -> None:
    first = LocalKafkaCluster(3, data_dir=tmp_path)
    first._prepare()
    saved = json.loads((tmp_path / CLUSTER_FILE_NAME).read_text())
    assert sorted(saved["ports"]) == ["1", "2", "3"]
    ports = [p for pair in saved["ports"].values() for p in pair]
    assert len(set(ports)) == 6
    again = LocalKafkaCluster(3, data_dir=tmp_path)
    again._prepare()
    assert again.bootstrap_servers == first.bootstrap_servers
    assert again.cluster_id == first.cluster_id
    node = again.node(2)
    assert node.node_id == 2
    assert node._requested_data_dir == tmp_path / "node-2"
    assert node._quorum_voters is not None and node._quorum_voters.count("@") == 3


def test_a_kept_cluster_of_another_size_is_refused(tmp_path: Path) -> None:
    LocalKafkaCluster(3, data_dir=tmp_path)._prepare()
    with pytest.raises(BrokerError, match="--brokers 3"):
        LocalKafkaCluster(5, data_dir=tmp_path)._prepare()


def test_a_temporary_cluster_dir_is_swept_only_when_owner_and_nodes_are_gone() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = Path(tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}cluster-test-"))
    try:
        (root / "node-1").mkdir()
        (root / "node-1" / "broker.pid").write_text(str(dead.pid))
        (root / "owner.pid").write_text(str(os.getpid()))
        _sweep_orphaned_data_dirs()
        assert root.exists(), "swept while its launcher lives (a whole-cluster bounce)"
        (root / "owner.pid").write_text(str(dead.pid))
        _sweep_orphaned_data_dirs()
        assert not root.exists()
    finally:
        if root.exists():
            shutil.rmtree(root)
