"""The scripts, read from the package: the repository's lua/ scripts (token_bucket.lua,
token_refund.lua, lease.lua, and request_ids.lua before each of quota.lua and
window.lua, and with bucket_ids.lua before each bucket script for a call with a request
id), copied in when the package is built."""

from importlib import resources


def _packaged(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


TOKEN_BUCKET_LUA: str = _packaged("token_bucket.lua")
TOKEN_REFUND_LUA: str = _packaged("token_refund.lua")
_BUCKET_IDS: str = _packaged("request_ids.lua") + _packaged("bucket_ids.lua")
TOKEN_BUCKET_IDS_LUA: str = _BUCKET_IDS + TOKEN_BUCKET_LUA
TOKEN_REFUND_IDS_LUA: str = _BUCKET_IDS + TOKEN_REFUND_LUA
LEASE_LUA: str = _packaged("lease.lua")
QUOTA_LUA: str = _packaged("request_ids.lua") + _packaged("quota.lua")
WINDOW_LUA: str = _packaged("request_ids.lua") + _packaged("window.lua")
