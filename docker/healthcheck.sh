#!/bin/sh
# The image's health check: healthy while the server answers PING on port 6379 inside
# the container (QAG_HEALTHCHECK_PORT to change it), with the password when one is set.
# An answer that asks for authentication (NOAUTH, or NOPERM for a user of an ACL file)
# is an answer too: the server is up, and it started only with the module loaded.
password=${QAG_PASSWORD:-}
if [ -z "$password" ] && [ -n "${QAG_PASSWORD_FILE:-}" ]; then
  password=$(cat "$QAG_PASSWORD_FILE" 2>/dev/null)
fi
if [ -n "$password" ]; then
  export REDISCLI_AUTH="$password"
fi
reply=$(redis-cli --no-auth-warning -p "${QAG_HEALTHCHECK_PORT:-6379}" ping 2>&1)
case $reply in
  PONG | NOAUTH* | *NOPERM*) exit 0 ;;
esac
echo "$reply"
exit 1
