"""What the tests, the demo and the benchmarks share: invariant checks, local worlds, small
datasets, a local S3 endpoint. Not used by the library itself.

* :mod:`~collective_loader.testing.invariants`: ``check(records, routing, expected, all_ids)``,
  from what every rank received: copies, shards, labels matching inputs, coverage, middle stages;
* :mod:`~collective_loader.testing.launch`: ``run(fn, args, world_size, timeout)``, a local gloo
  world (or the ranks ``torchrun`` started);
* :mod:`~collective_loader.testing.data`: small MDS datasets of known tokens, text and documents;
* :mod:`~collective_loader.testing.s3_endpoint`: :class:`S3Endpoint`, moto's S3 server on
  localhost, with the requests each client made.

The suite's helpers, not the library's API (none is exported): they may change with the tests.
"""
