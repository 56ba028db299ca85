"""Spark's Kafka connector jars, resolved with Maven into Snapline's cache (DESIGN §9): Spark's
own Ivy download is not used. Only the connector and what PySpark does not ship are fetched.

``python -m snapline.pipeline.spark.jars`` fetches them (CI does, beside the broker's jars).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from snapline.connectors.local.broker import _exclusive_lock, cache_dir, find_java, find_maven
from snapline.pipeline.errors import ConfigurationError

log = logging.getLogger(__name__)

#: The newest spark-sql-kafka-0-10 on Maven Central that works with the pinned PySpark: the
#: 4.3.0 connector was not published when this was written, and 4.2.0 reads Kafka with
#: PySpark 4.3.0 (tested by integration_tests/test_spark_bounded.py).
DEFAULT_CONNECTOR_VERSION = "4.2.0"
#: What the connector needs that PySpark's jars/ do not have (versions of its 4.2.0 pom).
_EXTRA = (
    ("org.apache.kafka", "kafka-clients", "3.9.2"),
    ("org.apache.commons", "commons-pool2", "2.13.1"),
)

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>snapline</groupId>
  <artifactId>spark-kafka-jars</artifactId>
  <version>1</version>
  <dependencies>
{deps}
  </dependencies>
</project>
"""


def connector_version() -> str:
    return os.environ.get("SNAPLINE_SPARK_KAFKA_VERSION", DEFAULT_CONNECTOR_VERSION)


def _dependencies(version: str) -> list[tuple[str, str, str]]:
    return [
        ("org.apache.spark", "spark-sql-kafka-0-10_2.13", version),
        ("org.apache.spark", "spark-token-provider-kafka-0-10_2.13", version),
        *_EXTRA,
    ]


def ensure_spark_kafka_jars(version: str | None = None) -> list[Path]:
    """The jar paths to pass as ``spark.jars`` (downloaded once into the cache)."""
    version = version or connector_version()
    home = cache_dir() / "spark-kafka" / version
    libs = home / "jars"
    marker = home / "complete"
    wanted = [f"{artifact}-{v}.jar" for _, artifact, v in _dependencies(version)]
    if marker.exists() and all((libs / name).is_file() for name in wanted):
        return [libs / name for name in wanted]
    home.mkdir(parents=True, exist_ok=True)
    # Concurrent callers (the test suite's parallel processes on a fresh cache) wait for each
    # other: two Mavens writing one directory can leave a truncated jar.
    with _exclusive_lock(home / ".lock"):
        if marker.exists() and all((libs / name).is_file() for name in wanted):
            return [libs / name for name in wanted]
        return _download(version, home, libs, marker, wanted)


def _download(version: str, home: Path, libs: Path, marker: Path, wanted: list[str]) -> list[Path]:
    deps = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in _dependencies(version)
    )
    (home / "pom.xml").write_text(_POM.format(deps=deps), "utf-8")
    find_java()
    command = [
        find_maven(),
        "-B",
        "-q",
        "-f",
        str(home / "pom.xml"),
        "dependency:copy-dependencies",
        "-DexcludeTransitive=true",
        f"-DoutputDirectory={libs}",
    ]
    log.info("downloading Spark's Kafka connector %s with Maven into %s", version, libs)
    result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    missing = [name for name in wanted if not (libs / name).is_file()]
    if result.returncode != 0 or missing:
        raise ConfigurationError(
            f"Maven could not fetch Spark's Kafka connector {version} ({missing or 'exit '}"
            f"{result.returncode}): {(result.stdout + result.stderr)[-800:]} — check access "
            "to Maven Central, or pick a published version with SNAPLINE_SPARK_KAFKA_VERSION"
        )
    marker.write_text(version)
    return [libs / name for name in wanted]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for jar in ensure_spark_kafka_jars():
        print(jar)


def spark_session(
    master: str, app_name: str, shuffle_partitions: int, config: dict[str, str] | None = None
) -> Any:
    """A SparkSession for Snapline's runners: the Kafka connector's jars, the driver on
    127.0.0.1, this process's ``sys.path`` for the executors' Python (the pipeline module
    must import there), and ``config`` on top."""
    from pyspark.sql import SparkSession

    jars = ensure_spark_kafka_jars()
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.jars", ",".join(str(j) for j in jars))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(sys.path))
    )
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
