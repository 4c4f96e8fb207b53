//! Prompt lookup, with vLLM's n-gram semantics: the longest suffix of the context, between
//! `prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred earlier in the context; of
//! equally long matches the earliest; the draft is what followed it, at most `k` tokens and
//! never past the context's end.

use super::Drafter;

/// The n-gram lengths tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSettings {
    pub min: usize,
    pub max: usize,
}

impl NgramSettings {
    /// n-grams longer than this are not tried: a step scans the context once per length.
    pub const MAX_LEN: usize = 64;

    pub fn new(min: usize, max: usize) -> Result<Self, String> {
        if min == 0 || min > max || max > Self::MAX_LEN {
            return Err(format!(
                "n-gram lengths must satisfy 1 <= min <= max <= {}, got min {min}, max {max}",
                Self::MAX_LEN
            ));
        }
        Ok(NgramSettings { min, max })
    }
}

/// Drafts from the request's own context; it keeps no state between calls.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    settings: NgramSettings,
}

impl NgramDrafter {
    pub fn new(settings: NgramSettings) -> Self {
        NgramDrafter { settings }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        // Longest first; a match must end before the context's last token (the suffix itself
        // is not a match), so an n-gram needs at least n + 1 tokens of context.
        for n in (self.settings.min..=self.settings.max.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            if let Some(start) = context[..len - 1]
                .windows(n)
                .position(|window| window == suffix)
            {
                let from = start + n;
                return context[from..len.min(from + k)].to_vec();
            }
        }
        Vec::new()
    }

    fn clone_box(&self) -> Box<dyn Drafter> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn drafter(min: usize, max: usize) -> NgramDrafter {
        NgramDrafter::new(NgramSettings::new(min, max).unwrap())
    }

    #[test]
    fn the_longest_match_wins_and_the_draft_stops_at_the_context_end() {
        // vLLM's own example: [4, 2, 3] never occurred before, [2, 3] did.
        assert_eq!(drafter(2, 3).propose(&[1, 2, 3, 4, 2, 3], 4), vec![4, 2, 3]);
        // [9, 2, 3] matches in full further back than [2, 3] alone does.
        let context = [7, 2, 3, 5, 9, 2, 3, 6, 1, 9, 2, 3];
        assert_eq!(drafter(1, 3).propose(&context, 2), vec![6, 1]);
        assert_eq!(
            drafter(1, 2).propose(&context, 2),
            vec![5, 9],
            "earliest of [2, 3]"
        );
    }

    #[test]
    fn of_equal_matches_the_earliest_and_no_draft_without_one() {
        assert_eq!(drafter(1, 1).propose(&[5, 1, 5, 2, 5], 1), vec![1]);
        assert!(drafter(2, 4).propose(&[1, 2, 3, 4], 3).is_empty());
        assert!(
            drafter(2, 2).propose(&[1, 1], 3).is_empty(),
            "too short to match"
        );
        assert!(drafter(1, 2).propose(&[1, 2, 1], 0).is_empty());
        // An occurrence may overlap the suffix: a run of one token drafts more of it.
        assert_eq!(drafter(2, 2).propose(&[8, 8, 8, 8], 5), vec![8, 8]);
    }

    #[test]
    fn lengths_are_checked() {
        assert!(NgramSettings::new(0, 3).is_err());
        assert!(NgramSettings::new(4, 3).is_err());
        assert!(NgramSettings::new(1, NgramSettings::MAX_LEN + 1).is_err());
        assert!(NgramSettings::new(1, 1).is_ok());
    }

    /// The reference: every length, every position, as the definition reads.
    fn by_definition(context: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let len = context.len();
        for n in (min..=max).rev() {
            if n >= len {
                continue;
            }
            for start in 0..len - n {
                if context[start..start + n] == context[len - n..] {
                    let from = start + n;
                    return context[from..(from + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    proptest! {
        #[test]
        fn drafts_as_the_definition_says(
            context in prop::collection::vec(0u32..4, 0..60),
            min in 1usize..4,
            extra in 0usize..4,
            k in 0usize..8,
        ) {
            let max = min + extra;
            let draft = drafter(min, max).propose(&context, k);
            prop_assert_eq!(&draft, &by_definition(&context, min, max, k));
            prop_assert!(draft.len() <= k);
        }
    }
}
