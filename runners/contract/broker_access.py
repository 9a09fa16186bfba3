"""What one runner may touch on the broker: its pool's keys and channels, nothing else.

Each enrolled runner connects to Redis as its own ACL user (named by its runner id), which
the control plane creates at enrollment and deletes at revocation
(``kestrel_one.execution.broker_users``). The user may:

- take commands from its pool's queue ``runner.<pool>`` (and kombu's priority lists of it),
  and bind to it;
- keep its pool's state under ``kestrel:pool:<pool>:``: the single-use call state
  (``runners.callstate``) and kombu's unacknowledged-message bookkeeping, which by
  default is one ``unacked`` hash shared by every consumer of the database (it holds the
  full messages in flight, so sharing it would hand every runner every pool's commands);
- receive its pool's control messages (``runner-control.<pool>``, a fanout exchange, that
  is a pub/sub channel);
- append to the reports queue ``reports`` (write only: it cannot read other runners'
  reports) and read, never change, that queue's binding table (a binding it could add would
  copy every report to a queue it reads). Not the control plane's own queue ``control``:
  its sweeps and deliveries are unsigned and trust their message.

A pool name is letters, digits, ``_``, ``-`` and ``.``, so no pool's names can be a prefix
pattern of another's here: ``:`` ends the state namespace and ``runner-control.`` is no
queue's prefix. Both tiers import this module: the control plane to write the user's
rules, the runner to name its keys and kombu's transport options.
"""

from __future__ import annotations

from kombu.transport.redis import PRIORITY_STEPS, Channel

from runners.contract.names import REPORT_QUEUE, control_exchange, runner_queue

__all__ = [
    "RUNNER_COMMANDS",
    "pool_namespace",
    "runner_acl_rules",
    "runner_transport_options",
]

# The commands kombu's Redis transport, Celery's worker and the call state use; everything
# else (KEYS, SCAN, FLUSHDB, CONFIG, CLIENT KILL, ACL changes, MONITOR, PUBSUB listings ...)
# is refused. Key and channel rules below apply to every one of these.
RUNNER_COMMANDS = (
    # AUTH, HELLO, PING, CLIENT SETNAME/SETINFO ...; not CLIENT KILL/LIST (admin, dangerous).
    "+@connection",
    "-@admin",
    "-@dangerous",
    "+select",
    "+acl|whoami",
    "+multi",
    "+exec",
    "+discard",
    "+watch",
    "+unwatch",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+expire",
    "+pexpire",
    "+ttl",
    "+pttl",
    "+time",
    "+brpop",
    "+rpop",
    "+lpush",
    "+rpush",
    "+llen",
    "+hget",
    "+hset",
    "+hdel",
    "+hgetall",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zrevrangebyscore",
    "+zrangebyscore",
    "+sadd",
    "+srem",
    "+smembers",
    "+publish",
    "+subscribe",
    "+psubscribe",
    "+unsubscribe",
    "+punsubscribe",
    "+eval",
    "+evalsha",
    "+script|load",
    "+script|exists",
)


def pool_namespace(pool: str) -> str:
    """The prefix of every key that holds pool ``pool``'s own state."""
    return f"kestrel:pool:{pool}:"


def runner_transport_options(pool: str) -> dict[str, str]:
    """kombu Redis transport options that keep a runner's unacknowledged messages in its
    pool's namespace instead of the database-wide ``unacked`` hash."""
    namespace = pool_namespace(pool)
    return {
        "unacked_key": f"{namespace}unacked",
        "unacked_index_key": f"{namespace}unacked_index",
        "unacked_mutex_key": f"{namespace}unacked_mutex",
    }


def _queue_keys(queue: str) -> list[str]:
    """The list keys kombu keeps a queue in: the queue itself and one per priority step."""
    return [queue if not step else f"{queue}{Channel.sep}{step}" for step in PRIORITY_STEPS]


def _binding_keys(exchange: str) -> list[str]:
    return [Channel.keyprefix_queue % exchange, Channel.keyprefix_binding_permanent % exchange]


def _fanout_channel(exchange: str, *, db: int) -> str:
    # kombu subscribes with PSUBSCRIBE to "<prefix><exchange>/<routing key>", the routing key
    # being the exchange's name (runners.worker); an ACL matches such a pattern literally.
    return f"{Channel.keyprefix_fanout.format(db=db)}{exchange}/{exchange}"


def runner_acl_rules(pool: str, *, db: int) -> list[str]:
    """The ACL rules (after ``reset``) of a runner of ``pool`` on broker database ``db``.

    Key patterns are exact names wherever kombu's names are known in advance; glob
    characters cannot occur in a pool name, so a pattern never reaches another pool.
    """
    queue = runner_queue(pool)
    exchange = control_exchange(pool)
    keys = [f"~{key}" for key in _queue_keys(queue)]
    keys += [f"~{key}" for key in _binding_keys(queue) + _binding_keys(exchange)]
    keys.append(f"~{pool_namespace(pool)}*")
    # Declaring the broadcast queue (``runner-control.<pool>.<uuid>``) asks its length; on
    # Redis it is a subscription, never a list anyone writes.
    keys.append(f"%R~{exchange}.*")
    # The reports queue: append only; its binding table: read only. Nothing else of the
    # control plane's: not its own queue ``control``, whose tasks trust their message.
    keys += [f"%W~{key}" for key in _queue_keys(REPORT_QUEUE)]
    keys += [f"%R~{key}" for key in _binding_keys(REPORT_QUEUE)]
    channels = [f"&{_fanout_channel(exchange, db=db)}"]
    return ["resetkeys", "resetchannels", "-@all", *RUNNER_COMMANDS, *keys, *channels]
