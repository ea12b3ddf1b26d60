"""What the tests, the demo and the benchmarks share: invariant checks, local worlds, a local S3
endpoint. Not used by the library itself."""
