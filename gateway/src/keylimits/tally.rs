//! What a request's tokens were, as far as its answer tells, for the tokens-per-minute limit.
//!
//! The gateway does not tokenize what it relays, so a request is charged what its answer reports:
//! the last `"total_tokens"` of its body (a JSON answer's `usage`, or a stream's usage chunk when
//! the client asked for one). An answer that reports none (a stream without usage, a client that
//! left, an error) is charged an estimate: a token per four bytes of the request (OpenAI's rule of
//! thumb for a prompt) plus a token per streamed event or per four bytes of a JSON answer.

use std::sync::Mutex;

use memchr::memmem;

const TOTAL: &[u8] = b"\"total_tokens\":";
const EVENT: &[u8] = b"data:";
/// The most bytes a `"total_tokens": N` can take after its name (spaces and a u64).
const NUMBER_SPAN: usize = 32;

/// Fed by whoever serves the request; read when its permit is dropped.
#[derive(Default)]
pub struct TokenTally(Mutex<Tally>);

#[derive(Default)]
struct Tally {
    /// Refused with a client error: nothing ran, nothing is charged.
    refused: bool,
    request_bytes: u64,
    reported: Option<u64>,
    scan: AnswerScan,
}

impl TokenTally {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The request's body was `bytes` long.
    pub fn request(&self, bytes: usize) {
        self.lock().request_bytes = bytes as u64;
    }

    /// The request was refused (a client error answered before anything ran): it is charged
    /// nothing unless a model reported tokens it used.
    pub fn refused(&self) {
        self.lock().refused = true;
    }

    /// The request used `total` tokens, as the model that served it counted them.
    pub fn used(&self, total: u64) {
        self.lock().reported = Some(total);
    }

    /// The next bytes of the answer, as they go to the client.
    pub fn answer(&self, bytes: &[u8]) {
        self.lock().scan.feed(bytes);
    }

    /// The tokens to charge: as reported, else the estimate (see the module's note).
    pub fn tokens(&self) -> u64 {
        let tally = self.lock();
        if let Some(total) = tally.reported.or(tally.scan.total) {
            return total;
        }
        if tally.refused {
            return 0;
        }
        let answer = if tally.scan.events > 0 {
            tally.scan.events
        } else {
            tally.scan.bytes.div_ceil(4)
        };
        tally.request_bytes.div_ceil(4) + answer
    }
}

/// Finds the last `"total_tokens": N` in an answer that arrives in pieces, and counts its bytes
/// and events. A piece is searched where it lies; only a name or number cut by a piece's end is
/// carried (copied) into the next.
#[derive(Default)]
struct AnswerScan {
    total: Option<u64>,
    events: u64,
    bytes: u64,
    carry: Vec<u8>,
}

impl AnswerScan {
    fn feed(&mut self, piece: &[u8]) {
        self.bytes += piece.len() as u64;
        self.events += memmem::find_iter(piece, EVENT).count() as u64;
        if self.carry.is_empty() {
            self.carry = self.scan(piece);
        } else {
            let mut joined = std::mem::take(&mut self.carry);
            joined.extend_from_slice(piece);
            self.carry = self.scan(&joined);
        }
    }

    /// Searches `data`, returning what must be carried into the next piece.
    fn scan(&mut self, data: &[u8]) -> Vec<u8> {
        for at in memmem::find_iter(data, TOTAL) {
            let rest = &data[at + TOTAL.len()..];
            match number(rest) {
                Some(n) => self.total = Some(n),
                // Cut by the piece's end: try again with the next piece.
                None if rest.len() < NUMBER_SPAN && !rest.contains(&b',') => {
                    return data[at..].to_vec();
                }
                None => {}
            }
        }
        // The name itself may be cut: keep the longest end of `data` that begins it.
        let longest = (1..TOTAL.len().min(data.len() + 1))
            .rev()
            .find(|&k| data.ends_with(&TOTAL[..k]));
        longest.map_or_else(Vec::new, |k| data[data.len() - k..].to_vec())
    }
}

/// The unsigned integer after optional spaces, when something other than a digit ends it.
fn number(rest: &[u8]) -> Option<u64> {
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = &rest[start..];
    let len = digits.iter().position(|b| !b.is_ascii_digit())?;
    if len == 0 {
        return None;
    }
    std::str::from_utf8(&digits[..len]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally_of(pieces: &[&[u8]]) -> TokenTally {
        let tally = TokenTally::default();
        for piece in pieces {
            tally.answer(piece);
        }
        tally
    }

    #[test]
    fn a_refused_request_is_charged_nothing_but_what_a_model_reported() {
        let tally = TokenTally::default();
        tally.request(12_000);
        assert_eq!(tally.tokens(), 3_000);
        tally.refused();
        assert_eq!(tally.tokens(), 0);
        tally.used(7);
        assert_eq!(tally.tokens(), 7);
    }

    #[test]
    fn the_last_reported_total_counts_wherever_the_pieces_are_cut() {
        let answer = br#"{"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens": 12}}"#;
        for cut in 0..answer.len() {
            let (a, b) = answer.split_at(cut);
            assert_eq!(tally_of(&[a, b]).tokens(), 12, "cut at {cut}");
        }
        let stream: &[&[u8]] = &[
            b"data: {\"choices\":[]}\n\n",
            b"data: {\"usage\":{\"total_tokens\":3",
            b"4}}\n\ndata: [DONE]\n\n",
        ];
        assert_eq!(tally_of(stream).tokens(), 34);
    }

    #[test]
    fn answers_without_usage_are_estimated() {
        // A stream: a token per event, plus a token per four bytes of the request.
        let tally = tally_of(&[b"data: {}\n\ndata: {}\n\n", b"data: [DONE]\n\n"]);
        tally.request(40);
        assert_eq!(tally.tokens(), 10 + 3);
        // A JSON answer: a token per four bytes of it.
        let tally = tally_of(&[br#"{"choices":[{"text":"hello"}]}"#]);
        assert_eq!(tally.tokens(), 8);
        // What the model reported wins over both.
        tally.used(99);
        assert_eq!(tally.tokens(), 99);
    }

    #[test]
    fn a_name_without_a_number_is_not_a_total() {
        let tally = tally_of(&[br#"{"total_tokens":"many","x":[1,2,3]}"#]);
        assert_eq!(tally.tokens(), 9);
    }
}
