"""The runtime service's repository: the only package that speaks SQL.

* `command_tx` — one command = one transaction in at most two round trips;
* `authority` — the fixed lock order of every fenced Worker command;
* one module per area (`placement`, `start_facts`, `lease_control`, `cancellation`,
  `convergence`, `retries`, `sessions`, `definitions`, `runs`), each with its statements in
  `sql/<module>.sql`, and `events`, the one writer of Run Events and their sequence;
* `admin` — administration's transactions, as the admin role (`pool.open_admin_pool`);
* `migrate` and `migrations/` — the schema, applied by the migration role;
* `bootstrap`, `identities`, `roles` — role and enrollment tooling of the migration role.
"""
