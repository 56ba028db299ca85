"""The Spark runner (DESIGN §10): the same declared pipeline on PySpark. ``bounded`` runs an
offset range (backfill, reprocessing) and hands over to the services through a savepoint;
``jars`` resolves Spark's Kafka connector with Maven; ``cli`` is ``snapline spark``."""
