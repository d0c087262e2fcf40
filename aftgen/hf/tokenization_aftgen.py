"""aftgen's tokenizer in Hugging Face transformers (trust_remote_code=True): the same ids for any text.

Written by aftgen beside tokenizer.model (a SentencePiece model with byte fallback and no normalisation).
aftgen escapes U+2581 (SentencePiece's space) and its own escape character before encoding, so that decoding
gives back the exact text; this does the same. Encoding puts the BOS first, as aftgen does before every text;
decoding drops it (and any control piece), as SentencePiece does.
"""

import re
import shutil
from pathlib import Path

import sentencepiece as spm
from transformers import PreTrainedTokenizer

ESCAPE, META = "\ue000", "\u2581"  # ESC ESC is a literal ESC, ESC + "s" a literal U+2581
UNESCAPE = re.compile(ESCAPE + "(.)", re.DOTALL)


def escape(text: str) -> str:
    return text.replace(ESCAPE, ESCAPE + ESCAPE).replace(META, ESCAPE + "s")


def unescape(text: str) -> str:
    return UNESCAPE.sub(lambda m: ESCAPE if m.group(1) == ESCAPE else META, text)


class AftgenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor(model_file=str(vocab_file))
        for name, piece_id in (("bos", self.sp.bos_id()), ("eos", self.sp.eos_id()), ("unk", self.sp.unk_id())):
            if piece_id >= 0:
                kwargs.setdefault(f"{name}_token", self.sp.id_to_piece(piece_id))
        kwargs.setdefault("split_special_tokens", True)  # "<s>" in a text is text, as in aftgen
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp.encode(escape(text), out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return unescape(self.sp.decode_pieces(tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return unescape(self.sp.decode(ids))

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        bos = [self.sp.bos_id()]
        return bos + token_ids_0 + (bos + token_ids_1 if token_ids_1 is not None else [])

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False) -> list[int]:
        if already_has_special_tokens:
            return [int(self.sp.is_control(i)) for i in token_ids_0 + (token_ids_1 or [])]
        return [1] + [0] * len(token_ids_0) + ([1] + [0] * len(token_ids_1) if token_ids_1 is not None else [])

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tokenizer.model"
        if Path(self.vocab_file).resolve() != target.resolve():
            shutil.copyfile(self.vocab_file, target)
        return (str(target),)
