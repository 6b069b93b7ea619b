#!/bin/sh
# qag's entrypoint: runs redis-server (or valkey-server) with the module loaded, and
# never open to the network unless the operator says so. One of, checked in this order:
#   /etc/qag/redis.conf mounted   the server's configuration, used as given (the
#                                 operator's choice of authentication and protected
#                                 mode; leave loadmodule for qag out of it)
#   QAG_PASSWORD, or QAG_PASSWORD_FILE (e.g. a Docker secret)
#                                 the default user's password (requirepass), passed
#                                 on standard input, never on the command line
#   QAG_ACL_FILE, or /etc/qag/users.acl mounted
#                                 the server's ACL file (aclfile)
#   QAG_ALLOW_NO_PASSWORD=yes     no password, protected mode off: anyone who reaches
#                                 the port may use the server
#   none of them                  no password, protected mode on: the server answers
#                                 clients on the container's own loopback only
#                                 (docker exec) and refuses every other with DENIED
# QAG_MODULE_ARGS: the module's load arguments (e.g. "CL-THROTTLE THROTTLE-SKEW 30").
# Arguments that start with "-" are the server's options; another program (a shell,
# redis-cli) runs as given.
set -eu

module=/usr/local/lib/redis/modules/libqag.so
config=/etc/qag/redis.conf
acl_file=${QAG_ACL_FILE:-/etc/qag/users.acl}

if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then
  set -- redis-server "$@"
fi
case $1 in
  redis-server | valkey-server) ;;
  *) exec "$@" ;;
esac
server=$1
shift
# QAG_MODULE_ARGS is a list of words: split on purpose.
# shellcheck disable=SC2086
set -- --loadmodule "$module" ${QAG_MODULE_ARGS:-} "$@"

say() { echo "qag-entrypoint: $*" >&2; }

if [ -f "$config" ]; then
  say "configuration $config, as given"
  exec "$server" "$config" "$@"
fi

password=${QAG_PASSWORD:-}
if [ -n "${QAG_PASSWORD_FILE:-}" ]; then
  [ -z "$password" ] || { say "set QAG_PASSWORD or QAG_PASSWORD_FILE, not both"; exit 1; }
  [ -r "$QAG_PASSWORD_FILE" ] || { say "cannot read QAG_PASSWORD_FILE $QAG_PASSWORD_FILE"; exit 1; }
  password=$(cat "$QAG_PASSWORD_FILE")
  [ -n "$password" ] || { say "QAG_PASSWORD_FILE $QAG_PASSWORD_FILE is empty"; exit 1; }
fi
acl=""
if [ -n "${QAG_ACL_FILE:-}" ] || [ -f "$acl_file" ]; then
  [ -r "$acl_file" ] || { say "cannot read the ACL file $acl_file"; exit 1; }
  acl=$acl_file
fi

if [ -n "$password" ]; then
  [ -z "$acl" ] || { say "a password and an ACL file: set one (users and their passwords go in the ACL file)"; exit 1; }
  line_break='
'
  case $password in
    *"$line_break"* | *"$(printf '\r')"*)
      say "the password holds a line break"
      exit 1
      ;;
  esac
  escaped=$(printf '%s' "$password" | sed 's/\\/\\\\/g; s/"/\\"/g')
  say "password required (requirepass)"
  exec "$server" - "$@" <<CONFIG
requirepass "$escaped"
CONFIG
fi
if [ -n "$acl" ]; then
  say "ACL file $acl"
  exec "$server" --aclfile "$acl" "$@"
fi
if [ "${QAG_ALLOW_NO_PASSWORD:-}" = yes ]; then
  say "no password and protected mode off (QAG_ALLOW_NO_PASSWORD=yes): anyone who reaches the port may use the server"
  exec "$server" --protected-mode no "$@"
fi
say "no password set: protected mode, the server answers clients on the container's loopback only; set QAG_PASSWORD, QAG_PASSWORD_FILE or QAG_ACL_FILE (or QAG_ALLOW_NO_PASSWORD=yes)"
exec "$server" --protected-mode yes "$@"
