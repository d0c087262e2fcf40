// OpenAI's `logprobs` JSON of tokens' scores, from the engine's score records: what aftgen.serve.replies's
// ScoresWriter writes in Python, byte for byte, for every token of a turn's events at once. Written in Python a
// token at a time, with `logprobs: 5` (six figures, six names), it cost the HTTP side as much a token inside a
// busy server as the rest of a chunk, on cores it shares with the engine; a call a chunk through ctypes, less than
// half of that (figures: docs/benchmarks.md).
//
// tokens: "token top chat record" for each, separated by spaces: `top` alternatives at most, chat 1 for chat's
// shape; a record is aftgen.generation.scores' (the hex of little-endian float32 [the token's log-probability, the
// alternatives'] then int32 [their ids]), "-" for none. Out, for each token, after a RECORD separator from the
// one before: completions' name, figure and {name: figure, ...} map, between UNIT separators, or chat's whole
// entry. A figure is written as "%.9g" writes it (Python's too): 9 digits give a float32 back exactly (snprintf
// took a quarter of a microsecond a figure; format_figure writes one in a fifth of that).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int MOST = 64;  // alternatives a record holds at most (top_scores.cpp's MOST)

// The tokenizer's names, made JSON once (ScoresWriter's): token t's is text[at[t] .. at[t + 1]), chat's entry start
// entries[entry_at[t] .. entry_at[t + 1]), and first[t] the lowest id with t's text (completions name a text once).
struct Names {
    const char* text;
    const int64_t* at;
    const char* entries;
    const int64_t* entry_at;
    const int32_t* first;
    int64_t vocab;
};

// The nine decimal digits of q (10^8 <= q < 10^9), into `out`.
void write_nine_digits(uint64_t q, char* out) {
    for (int i = 8; i >= 0; --i, q /= 10) out[i] = char('0' + q % 10);
}

// |v| rounded to 9 significant digits, half to even, as q (10^8 <= q < 10^9) and the decimal exponent x of its
// first digit: false where |v| is outside [1e-22, 1e9), whose figures go through snprintf. A float32 is m 2^e,
// and m 10^(8 - x) fits in 128 bits for 8 - x up to 30, so the rounding is exact.
bool nine_digits(float v, uint64_t& q, int& x) {
    const float a = v < 0 ? -v : v;
    if (!(a >= 1e-22f && a < 1e9f)) return false;
    int e;
    const float fraction = std::frexp(a, &e);  // a = fraction 2^e, fraction in [0.5, 1)
    const unsigned __int128 m = static_cast<uint64_t>(std::ldexp(fraction, 24));  // a = m 2^(e - 24), exactly
    e -= 24;
    x = int(std::floor(std::log10(double(a))));
    for (int tries = 0; tries < 3; ++tries) {
        const int k = 8 - x;
        if (k < 0 || k > 30) return false;
        unsigned __int128 n = m;
        for (int i = 0; i < k; ++i) n *= 10;
        if (e >= 0) {
            q = uint64_t(n << e);
        } else {
            const int shift = -e;
            if (shift >= 127) return false;
            const unsigned __int128 one = 1, low = n & ((one << shift) - 1), half = one << (shift - 1);
            q = uint64_t(n >> shift);
            if (low > half || (low == half && (q & 1))) ++q;
        }
        if (q >= 1000000000ull) {
            ++x;
        } else if (q < 100000000ull) {
            --x;
        } else {
            return true;
        }
    }
    return false;
}

// `v` as "%.9g" writes it, into out (32 bytes): returns the length.
int format_figure(float v, char* out) {
    if (v != v) return std::snprintf(out, 32, "nan");  // as Python writes it, whatever the sign (glibc: "-nan")
    uint64_t q;
    int x;
    if (v == 0 || !nine_digits(v, q, x)) return std::snprintf(out, 32, "%.9g", double(v));
    char digit[9];
    write_nine_digits(q, digit);
    int length = 9;
    while (length > 1 && digit[length - 1] == '0') --length;  // %g drops trailing zeros
    int n = 0;
    if (v < 0) out[n++] = '-';
    if (x < -4 || x >= 9) {  // d.ddde-XX
        out[n++] = digit[0];
        if (length > 1) out[n++] = '.';
        for (int i = 1; i < length; ++i) out[n++] = digit[i];
        return n + std::snprintf(out + n, 8, "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    }
    if (x < 0) {  // 0.000ddd
        out[n++] = '0';
        out[n++] = '.';
        for (int i = 0; i < -x - 1; ++i) out[n++] = '0';
        for (int i = 0; i < length; ++i) out[n++] = digit[i];
        return n;
    }
    for (int i = 0; i <= x; ++i) out[n++] = i < length ? digit[i] : '0';  // ddd[.ddd]
    if (length > x + 1) {
        out[n++] = '.';
        for (int i = x + 1; i < length; ++i) out[n++] = digit[i];
    }
    return n;
}

struct Score {
    int64_t token;
    bool chat;  // chat's shape
    bool scored;  // false: nothing predicts the token (NO_SCORES)
    float logprob;
    int count;  // alternatives kept (at most `top`)
    float values[MOST];
    int32_t ids[MOST];
};

// Writes into [at, end): each put returns false once the output would not fit.
struct Out {
    char* at;
    char* end;
    bool put(const char* text, size_t n) {
        if (size_t(end - at) < n) return false;
        std::memcpy(at, text, n);
        at += n;
        return true;
    }
    bool put(const char* text) { return put(text, std::strlen(text)); }
    bool figure(float v) {
        char text[32];
        const int n = format_figure(v, text);
        return n > 0 && put(text, size_t(n));
    }
    bool logprob(const Score& score) { return score.scored ? figure(score.logprob) : put("null"); }
};

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;  // as Python's bytes.fromhex reads them
    return -1;
}

// The 32-bit little-endian word at `hex` (8 digits), or false where a digit is not one.
bool word(const char* hex, uint32_t& value) {
    value = 0;
    for (int byte = 0; byte < 4; ++byte) {
        const int high = hex_digit(hex[2 * byte]), low = hex_digit(hex[2 * byte + 1]);
        if (high < 0 || low < 0) return false;
        value |= uint32_t(high * 16 + low) << (8 * byte);
    }
    return true;
}

// A number of at most 18 decimal digits from `text` and the space after it (before `limit`), moved past both;
// false where there is none.
bool field(const char*& text, const char* limit, int64_t& value) {
    const char* at = text;
    value = 0;
    for (; at < limit && at - text < 18 && *at >= '0' && *at <= '9'; ++at) value = value * 10 + (*at - '0');
    if (at == text || at == limit || *at != ' ') return false;
    text = at + 1;
    return true;
}

// One "token top chat record" from `text` (before `limit`), moved past it; false where it is malformed or names a
// token outside the vocabulary.
bool read_score(const char*& text, const char* limit, int64_t vocab, Score& score) {
    int64_t top, chat;
    if (!field(text, limit, score.token) || !field(text, limit, top) || !field(text, limit, chat)) return false;
    if (score.token >= vocab || top > MOST || chat > 1) return false;
    score.chat = chat == 1;
    const char* end = text;
    while (end < limit && *end != ' ') ++end;
    const int64_t words = (end - text) / 8;
    score.scored = !(end - text == 1 && *text == '-');
    score.count = 0;
    if (score.scored) {
        const int64_t held = (words - 1) / 2;
        if ((end - text) % 8 != 0 || words < 1 || words % 2 != 1 || held > MOST) return false;
        score.count = int(held < top ? held : top);
        uint32_t bits;
        for (int64_t i = 0; i < 1 + score.count; ++i) {
            if (!word(text + 8 * i, bits)) return false;
            std::memcpy(i == 0 ? &score.logprob : &score.values[i - 1], &bits, sizeof bits);
        }
        for (int i = 0; i < score.count; ++i) {
            if (!word(text + 8 * (1 + held + i), bits) || int32_t(bits) < 0 || int64_t(int32_t(bits)) >= vocab)
                return false;
            score.ids[i] = int32_t(bits);
        }
    }
    text = end < limit ? end + 1 : end;
    return true;
}

bool name(Out& out, const Names& names, int64_t token) {
    return out.put(names.text + names.at[token], size_t(names.at[token + 1] - names.at[token]));
}

bool entry(Out& out, const Names& names, int64_t token) {
    return out.put(names.entries + names.entry_at[token], size_t(names.entry_at[token + 1] - names.entry_at[token]));
}

// {name: figure, ...}: of the alternatives with one text, the first (the likelier) only.
bool alternatives_map(Out& out, const Names& names, const Score& score) {
    if (!out.put("{")) return false;
    bool any = false;
    for (int i = 0; i < score.count; ++i) {
        bool named = false;
        for (int j = 0; j < i && !named; ++j) named = names.first[score.ids[j]] == names.first[score.ids[i]];
        if (named) continue;
        if ((any && !out.put(",")) || !name(out, names, score.ids[i]) || !out.put(":") || !out.figure(score.values[i]))
            return false;
        any = true;
    }
    return out.put("}");
}

constexpr char UNIT = '\x1f', RECORD = '\x1e';  // JSON escapes both inside its strings, and has none outside

// completions' name, figure and map, UNIT between them.
bool completions_parts(Out& out, const Names& names, const Score& score) {
    const char unit[1] = {UNIT};
    return name(out, names, score.token) && out.put(unit, 1) && out.logprob(score) && out.put(unit, 1) &&
           (score.scored ? alternatives_map(out, names, score) : out.put("null"));
}

// chat's entry: {"token":...,"bytes":[...],"logprob":figure,"top_logprobs":[entry, ...]}
bool chat_entry(Out& out, const Names& names, const Score& score) {
    if (!entry(out, names, score.token) || !out.logprob(score) || !out.put(",\"top_logprobs\":["))
        return false;
    for (int j = 0; j < score.count; ++j)
        if ((j && !out.put(",")) || !entry(out, names, score.ids[j]) || !out.figure(score.values[j]) || !out.put("}"))
            return false;
    return out.put("]}");
}

}  // namespace

extern "C" {

// format_figure, for tests: `v` as "%.9g" writes it into out (32 bytes), returning the length.
int aftgen_format_figure(float v, char* out) { return format_figure(v, out); }

// Writes the shown form of `count` tokens' scores (`tokens`: `length` bytes, see the top) into out[0 .. size).
// Returns its length, or -1 where `tokens` is malformed or names a token outside the vocabulary, -2 where `size` is
// too small.
int64_t aftgen_score_json(const Names* names, const char* tokens, int64_t length, int64_t count, char* out,
                          int64_t size) {
    const char* text = tokens;
    const char* const limit = tokens + length;
    Out written{out, out + size};
    const char record[1] = {RECORD};
    Score score;
    for (int64_t i = 0; i < count; ++i) {
        if (!read_score(text, limit, names->vocab, score)) return -1;
        const bool fits = (i == 0 || written.put(record, 1)) &&
                          (score.chat ? chat_entry(written, *names, score) : completions_parts(written, *names, score));
        if (!fits) return -2;
    }
    return text == limit ? written.at - out : -1;
}

}  // extern "C"
