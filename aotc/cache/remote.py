"""A remote cache on S3 (or any S3-compatible server): read-through, write-back.

    s3://bucket/prefix/<key>/<file>        the artifact's files
    s3://bucket/prefix/<key>/record.json   written last: an entry without it is incomplete

Endpoint and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). A remote that is down or refuses
a request never fails a build: the error is counted, reported in the build
summary, and the remote is not asked again during that build. Downloads are
verified (sha256) before they enter the local cache.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from ..errors import AotcError
from ..format import CompiledRecord, bad_file, encode
from .local import RECORD, CacheError, read_record


class RemoteCache:
    def __init__(self, url: str):
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise AotcError(f"--remote-cache {url!r}: expected s3://bucket/prefix")
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise AotcError("--remote-cache needs boto3: pip install 'aotc[s3]'") from None
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        # Fail fast: a dead remote should cost seconds, not minutes of retries.
        config = Config(connect_timeout=3, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"})
        self.client = boto3.client("s3", config=config)
        self.errors: list[str] = []
        self.down = False

    def _key(self, key: str, name: str) -> str:
        return f"{self.prefix}/{key}/{name}" if self.prefix else f"{key}/{name}"

    def _failed(self, what: str, error: Exception) -> None:
        self.errors.append(f"{what}: {type(error).__name__}: {error}")
        self.down = True

    def fetch(self, key: str, into: Path) -> CompiledRecord | None:
        """Download the entry into the folder `into` and return its record; None on a miss or error."""
        if self.down:
            return None
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key, RECORD))["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            self._failed(f"get {key}", e)
            return None
        except BotoCoreError as e:
            self._failed(f"get {key}", e)
            return None
        try:
            record = read_record(body, f"{self.url}/{key}/{RECORD}")
            for name in record.files:
                self.client.download_file(self.bucket, self._key(key, name), str(into / name))
            bad = bad_file(into, record.files)
            if bad:
                self.errors.append(f"get {key}: {bad[0].name}: {bad[1]}; ignored")
                return None
        except CacheError as e:
            self.errors.append(f"get {key}: {e}; ignored")
            return None
        except (BotoCoreError, ClientError, OSError) as e:
            self._failed(f"get {key}", e)
            return None
        return record

    def store(self, key: str, folder: Path, record: CompiledRecord) -> None:
        """Upload an entry; the record goes last, so readers never see half an entry."""
        if self.down:
            return
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for name in record.files:
                self.client.upload_file(str(folder / name), self.bucket, self._key(key, name))
            self.client.put_object(Bucket=self.bucket, Key=self._key(key, RECORD), Body=encode(record))
        except (BotoCoreError, ClientError, OSError) as e:
            self._failed(f"put {key}", e)
