"""The tests' S3 bucket on the local endpoint (``conftest.s3``), shared with the scripts the two-node
tests run (which do not see conftest)."""

from __future__ import annotations

from collective_loader.testing.s3_endpoint import S3Endpoint

S3_BUCKET = "collective-loader-tests"


def s3_shards(s3: S3Endpoint, remote: str) -> list[str]:
    """The keys of the shards under ``remote`` (``s3://S3_BUCKET/prefix``), sorted."""
    prefix = remote.split("/", 3)[3] + "/"
    listing = s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)["Contents"]
    return sorted(o["Key"] for o in listing if o["Key"].endswith(".mds"))
