"""``python -m collective_loader demo``: one epoch of a StreamingDataset on a 4-D-capable mesh.

Writes a small tokenized MDS dataset (or reads ``--data DIR``), starts a local gloo world (or runs
under torchrun), and delivers one epoch through :class:`StreamingSource` + ``CollectiveLoader``.
Rank 0 then prints every rank's role and first batch, samples per replica, the collectives and
bytes moved, and the verdict of the invariant checks. Last, it runs the seed issue's naive set-up
on the same mesh and data (every rank builds its own StreamingDataset with ``replication = tp *
cp``) and prints, side by side, the share of steps whose last-stage labels do not belong to the
first stage's inputs. Exit code 1 if a check of our loader fails (the naive run is the comparison,
not a check: if it fails, the report says so and why in one line); 2, with one line on stderr naming
the flag to give, for any flag it cannot run with, found before any rank starts.

``--data DIR`` may also hold LLM data as LLM Foundry writes it (a ``text`` column, given
``--tokenizer PATH`` and how to frame each document; a ``tokens`` column of bytes, given
``--token-dtype``; or of ndarray): the leaders then tokenize and pack documents into rows of
``--seq-len + 1`` tokens, the checks run on the rows each leader made, and rank 0 prints the
packing figures. The naive run is left out there.

One job per module:

* :mod:`~collective_loader.cli.main`: the command, from flags to the world;
* :mod:`~collective_loader.cli.args`: the flags, ``--mesh``'s grammar, what every rank is given;
* :mod:`~collective_loader.cli.preflight`: the flags and the data checked on the launching process;
* :mod:`~collective_loader.cli.run`: one rank: the epoch, then the phases after it;
* :mod:`~collective_loader.cli.naive`: the naive set-up of streaming#827;
* :mod:`~collective_loader.cli.report`: rank 0's report and verdict;
* :mod:`~collective_loader.cli.s3`: ``--remote``'s local S3 endpoint and what each rank fetched.
"""
