"""Chat messages as the plain text `aftgen chat` reads: a user line ends in a newline, a reply in a blank line.

Each message is tokenized on its own, as `aftgen chat` reads each line on its own. A conversation
that grows by a turn then keeps every earlier token as it was, which is what lets the prefix cache
find the state after the history.
"""

from __future__ import annotations

from aftgen.chat import REPLY_END
from aftgen.tokenizer import Tokenizer

ENDINGS = {"system": REPLY_END, "developer": REPLY_END, "user": "\n", "assistant": REPLY_END}
ROLES = tuple(ENDINGS)


def message_text(role: str, content: str) -> str:
    return content + ENDINGS[role]


def chat_ids(tokenizer: Tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """Token ids of (role, content) messages, each message tokenized on its own."""
    return [token for role, content in messages for token in tokenizer.encode(message_text(role, content))]
