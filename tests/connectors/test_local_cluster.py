"""The local multi-node cluster's layout (no broker needed): ports and cluster id chosen once
and kept, one data dir and one static voter per node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
