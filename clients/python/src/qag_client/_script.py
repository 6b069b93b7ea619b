"""The token-bucket script, read from the package: the repository's
lua/token_bucket.lua, copied in when the package is built."""

from importlib import resources

TOKEN_BUCKET_LUA: str = (
    resources.files(__package__).joinpath("token_bucket.lua").read_text(encoding="utf-8")
)
