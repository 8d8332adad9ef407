"""Who gets the box when several people and programs share it: each request's class and weight
(`Share`, from its key or its listener's anonymous table), the tokens each key used lately
(book.py, which a slot's queue and a group's turns read), and each key's token quotas
(quotas.py).

    interactive   the default: a person waiting for an answer (a chat, an agent's turn)
    batch         work nobody waits on (a nightly embedding run): served after interactive
                  work, in a slot's queue and in the choice of whose model loads next, and never
                  the reason for a swap while the loaded model has interactive work; after
                  `[dispatcher] batch_max_wait_s` a batch request goes first (never starved)

Within one class, keys are served in proportion to their `weight`, counted in tokens (prompt and
generated) over `[dispatcher] share_window_s`, so a key does not get more of the GPU by sending
longer prompts.
"""

from hal0d.shares.share import BATCH, DEFAULT_SHARE, INTERACTIVE, SERVICE_CLASSES, Share

__all__ = ["BATCH", "DEFAULT_SHARE", "INTERACTIVE", "SERVICE_CLASSES", "Share"]
