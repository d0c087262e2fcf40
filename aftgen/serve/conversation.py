"""Chat messages as token ids, in `aftgen chat`'s format (aftgen.chat.message_text).

Each message is tokenized on its own, as `aftgen chat` reads each line on its own. A conversation
that grows by a turn then keeps every earlier token as it was, which is what lets the prefix cache
find the state after the history.
"""

from __future__ import annotations

from aftgen.chat import message_text
from aftgen.tokenizer import Tokenizer


def chat_ids(tokenizer: Tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """Token ids of (role, content) messages, each message tokenized on its own."""
    return [token for role, content in messages for token in tokenizer.encode(message_text(role, content))]
