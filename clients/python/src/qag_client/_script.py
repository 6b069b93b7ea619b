"""The token-bucket scripts, read from the package: the repository's
lua/token_bucket.lua and lua/token_refund.lua, copied in when the package is built."""

from importlib import resources


def _packaged(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


TOKEN_BUCKET_LUA: str = _packaged("token_bucket.lua")
TOKEN_REFUND_LUA: str = _packaged("token_refund.lua")
