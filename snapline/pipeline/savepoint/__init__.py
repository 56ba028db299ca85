"""Savepoints: user-triggered, self-contained, portable snapshots (DESIGN §5).

``format`` (the files), ``export`` (writing one from committed checkpoints), ``restore``
(starting a job from one, with rescaling by key-groups), ``control`` (how a running job is
asked for one), ``cli`` (the ``snapline savepoint`` commands).
"""
