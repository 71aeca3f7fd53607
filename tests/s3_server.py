"""An S3-compatible server on localhost for the object-storage tests: moto's server mode, started as a process.

``S3Server.start()`` runs ``python -m moto.server`` on a free port and waits until it answers; ``env()`` is what a
run needs to reach it through boto3's standard places (``AWS_ENDPOINT_URL``, the access keys, a region), the only
places Deepy reads them from. ``bucket(name)`` creates a bucket. No boto3 call is mocked: the tests' requests
travel over HTTP to a real server that stores the objects in its memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ports import free_port


class S3Server:
    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.port, self.process, self.log = port, process, log
        self.url = f"http://127.0.0.1:{port}"

    @staticmethod
    def start(log: Path) -> S3Server:
        port = free_port()
        handle = log.open("wb")
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(5 * 1024 * 1024)}
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=handle, stderr=subprocess.STDOUT, env=env)
        server = S3Server(port, process, log)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(server.url + "/moto-api/", timeout=2).read()
                return server
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "deepy-test", "AWS_SECRET_ACCESS_KEY": "deepy-test",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="deepy-test",
                            aws_secret_access_key="deepy-test", region_name="us-east-1")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object below ``prefix``: key (relative to the prefix) -> bytes."""
        client, found = self.client(), {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                found[item["Key"][len(prefix):].lstrip("/")] = body
        return found

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
