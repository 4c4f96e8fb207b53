//! A request on its way: where it went, when, and what came back so far.

/// A request sent to a replica (a prefill leg is one too).
pub(super) struct Sent {
    pub(super) job: usize,
    pub(super) gateway: usize,
    pub(super) replica: usize,
    pub(super) sent_us: u64,
    pub(super) first_us: Option<u64>,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: u32,
    pub(super) output: Vec<u32>,
    /// A prefill leg: the decode leg its prompt's blocks go to once it is done.
    pub(super) hand_to: Option<u64>,
    pub(super) last_token_us: Option<u64>,
    /// Gaps between its tokens, in seconds.
    pub(super) itl_s: Vec<f64>,
}

impl Sent {
    pub(super) fn new(
        job: usize,
        gateway: usize,
        replica: usize,
        sent_us: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> Sent {
        Sent {
            job,
            gateway,
            replica,
            sent_us,
            first_us: None,
            prompt,
            max_tokens,
            output: Vec::new(),
            hand_to: None,
            last_token_us: None,
            itl_s: Vec::new(),
        }
    }
}
