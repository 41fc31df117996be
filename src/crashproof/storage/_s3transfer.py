"""Large local files to S3 through boto3's transfer manager.

s3fs uploads the parts of a multipart upload concurrently, but from one asyncio event loop: on a
busy host it moves about as fast as one stream (``benchmarks/tiers.py`` measured it at the speed
of boto3 with a single thread). boto3's transfer manager pushes parts from a pool of threads. For
``FsspecStorage.put_file`` on ``s3://`` crashproof therefore uses boto3 when it is installed
(``pip install boto3``; moto and most AWS set-ups have it: it is not a dependency, since
its botocore pin must match aiobotocore's), configured from the s3fs filesystem's own options
(credentials, endpoint, client and botocore settings), and s3fs otherwise.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["S3Uploader", "s3_uploader"]

log = logging.getLogger("crashproof.storage")

PART_BYTES = 16 * 1024 * 1024
THREADS = 8


class S3Uploader:
    """``upload(local_path, "bucket/key")`` with boto3's threaded multipart transfer."""

    def __init__(self, fs: Any) -> None:
        import boto3
        import botocore.config
        from boto3.s3.transfer import TransferConfig

        client_kwargs = dict(getattr(fs, "client_kwargs", None) or {})
        endpoint = getattr(fs, "endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
        config = botocore.config.Config(
            max_pool_connections=THREADS * 2, **dict(getattr(fs, "config_kwargs", None) or {})
        )
        if getattr(fs, "anon", False):
            config = config.merge(botocore.config.Config(signature_version=botocore.UNSIGNED))
        session = boto3.session.Session(
            aws_access_key_id=getattr(fs, "key", None),
            aws_secret_access_key=getattr(fs, "secret", None),
            aws_session_token=getattr(fs, "token", None),
        )
        self._client = session.client("s3", endpoint_url=endpoint, config=config, **client_kwargs)
        self._config = TransferConfig(
            multipart_threshold=PART_BYTES,
            multipart_chunksize=PART_BYTES,
            max_concurrency=THREADS,
            use_threads=True,
        )
        self._extra = dict(getattr(fs, "s3_additional_kwargs", None) or {})

    def upload(self, local_path: str, key: str) -> None:
        bucket, _, name = key.partition("/")
        self._client.upload_file(
            local_path, bucket, name, Config=self._config, ExtraArgs=self._extra or None
        )


_lock = threading.Lock()


def s3_uploader(fs: Any) -> S3Uploader | None:
    """A boto3 uploader configured like ``fs``; None when boto3 is missing or the options do not
    translate (then s3fs uploads)."""
    with _lock:
        try:
            return S3Uploader(fs)
        except ImportError:
            return None
        except Exception as exc:  # an option boto3 does not take: s3fs still works
            log.info("uploading with s3fs, not boto3 (%s: %s)", type(exc).__name__, exc)
            return None
