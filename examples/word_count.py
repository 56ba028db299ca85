"""Word count per chat channel: messages keyed by channel, a MapState of word counts each.

Input ``chat`` (string values, Kafka key = channel name). Output ``word-counts``: one
{"channel", "word", "count"} per word occurrence, with the running count of that word in
that channel. Run: ``snapline run examples.word_count:pipeline`` (SNAPLINE_EXAMPLE_PREFIX
prefixes the topic names, SNAPLINE_EXAMPLE_JOB names the job).

The messages are keyed by channel in Kafka, so ``key_by()`` (by the message key) needs no
repartition topic. A global word count would re-key by word: ``.flat_map(words)
.key_by(lambda w: w, name="by-word")`` crosses a repartition topic into a second stage.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

from snapline import Context, KafkaSink, KafkaSource, KeyedProcessFunction, MapState, Pipeline

WORD = re.compile(r"[a-z0-9']+")


class CountWords(KeyedProcessFunction):
    counts = MapState("counts")

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        for word in value["words"]:
            count = self.counts.get(word, 0) + 1
            self.counts.put(word, count)
            yield {"channel": ctx.key, "word": word, "count": count}


_prefix = os.environ.get("SNAPLINE_EXAMPLE_PREFIX", "")
pipeline = Pipeline(os.environ.get("SNAPLINE_EXAMPLE_JOB", "word-count"), checkpoint_interval=1.0)
(
    pipeline.source(KafkaSource(f"{_prefix}chat", value_format="string", create_partitions=4))
    .filter(lambda line: bool(line.strip()))
    .map(lambda line: {"words": WORD.findall(line.lower())})
    .key_by(name="channel")  # the Kafka message key
    .process(CountWords())
    .sink(KafkaSink(f"{_prefix}word-counts", create_partitions=4))
)
