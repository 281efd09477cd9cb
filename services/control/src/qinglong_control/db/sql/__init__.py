"""The control service's SQL catalogue: every runtime statement, by name.

One `.sql` file per repository module (`authority.sql` holds `db/authority.py`'s
statements), plus `clock.sql`, the one definition of DB time. Modules look statements up
once, at import: a missing name fails the import, and a test fails on a statement that
no module uses. Migration and bootstrap tooling (`migrate.py`, `bootstrap.py`,
`identities.py`) and the transaction frame (`command_tx.py`) keep their few statements
inline: they run as other roles or are protocol, not queries.
"""

from __future__ import annotations

from typing import Final

from qinglong_protocol.sql_catalogue import SqlCatalogue

SQL: Final = SqlCatalogue(__name__)
