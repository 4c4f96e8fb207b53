//! The request's either-or fields (`prompt`, a message's `content`) read in one pass. Serde's
//! untagged enums buffer the whole value before they try each variant: for a prompt of 20,000
//! token ids that took 20 ns an id. Here the first element decides what the rest must be.

use super::{ContentPart, MessageContent, Prompt};
use serde::de::value::SeqAccessDeserializer;
use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use std::fmt;

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a list of strings, a list of token ids or a list of such lists")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let hint = seq.size_hint().unwrap_or(0).min(4096);
        Ok(match seq.next_element::<FirstItem>()? {
            // An empty list reads as no texts, as the untagged enum read it.
            None => Prompt::Texts(Vec::new()),
            Some(FirstItem::Text(first)) => Prompt::Texts(rest(first, hint, &mut seq)?),
            Some(FirstItem::Id(first)) => Prompt::Tokens(rest(first, hint, &mut seq)?),
            Some(FirstItem::Ids(first)) => Prompt::TokenLists(rest(first, hint, &mut seq)?),
        })
    }
}

/// The first element and the elements after it, all of the first one's kind.
fn rest<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(
    first: T,
    hint: usize,
    seq: &mut A,
) -> Result<Vec<T>, A::Error> {
    let mut all = Vec::with_capacity(hint.max(1));
    all.push(first);
    while let Some(next) = seq.next_element()? {
        all.push(next);
    }
    Ok(all)
}

/// A list prompt's first element: a text, a token id, or a list of token ids.
enum FirstItem {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for FirstItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FirstItemVisitor)
    }
}

struct FirstItemVisitor;

impl<'de> Visitor<'de> for FirstItemVisitor {
    type Value = FirstItem;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id (0 to 4294967295) or a list of token ids")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<FirstItem, E> {
        Ok(FirstItem::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<FirstItem, E> {
        Ok(FirstItem::Text(s))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<FirstItem, E> {
        u32::try_from(v)
            .map(FirstItem::Id)
            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<FirstItem, A::Error> {
        Vec::deserialize(SeqAccessDeserializer::new(seq)).map(FirstItem::Ids)
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor)
    }
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = MessageContent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or a list of content parts")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<MessageContent, E> {
        Ok(MessageContent::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<MessageContent, E> {
        Ok(MessageContent::Text(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<MessageContent, A::Error> {
        Vec::<ContentPart>::deserialize(SeqAccessDeserializer::new(seq)).map(MessageContent::Parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;
    use serde_json::{json, Value};

    /// What the derived untagged enums read: the reference the one-pass readers must match.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum UntaggedPrompt {
        Text(String),
        Texts(Vec<String>),
        Tokens(Vec<u32>),
        TokenLists(Vec<Vec<u32>>),
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum UntaggedContent {
        Text(String),
        Parts(Vec<ContentPart>),
    }

    fn as_untagged(p: Prompt) -> UntaggedPrompt {
        match p {
            Prompt::Text(s) => UntaggedPrompt::Text(s),
            Prompt::Texts(v) => UntaggedPrompt::Texts(v),
            Prompt::Tokens(v) => UntaggedPrompt::Tokens(v),
            Prompt::TokenLists(v) => UntaggedPrompt::TokenLists(v),
        }
    }

    fn both_read_alike(text: &str) -> Result<(), TestCaseError> {
        let fast = serde_json::from_str::<Prompt>(text).map(as_untagged).ok();
        let reference = serde_json::from_str::<UntaggedPrompt>(text).ok();
        prop_assert_eq!(fast, reference, "prompt {}", text);
        let fast = serde_json::from_str::<MessageContent>(text).ok();
        let reference = serde_json::from_str::<UntaggedContent>(text)
            .ok()
            .map(|c| match c {
                UntaggedContent::Text(s) => MessageContent::Text(s),
                UntaggedContent::Parts(p) => MessageContent::Parts(p),
            });
        prop_assert_eq!(fast, reference, "content {}", text);
        Ok(())
    }

    /// JSON values of the shapes these fields take, and of the shapes they must refuse.
    fn values() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            "[a-z\"\\\\é]{0,6}".prop_map(Value::from),
            (0u64..8).prop_map(Value::from),
            prop_oneof![Just(u64::from(u32::MAX)), Just(u64::from(u32::MAX) + 1)]
                .prop_map(Value::from),
            (-3i64..0).prop_map(Value::from),
            Just(json!(1.5)),
            Just(json!({"type": "text", "text": "hi"})),
            Just(json!({"type": "image_url"})),
        ];
        leaf.prop_recursive(3, 24, 5, |inner| {
            prop::collection::vec(inner, 0..5).prop_map(Value::Array)
        })
    }

    proptest! {
        #[test]
        fn prompt_and_content_read_as_the_untagged_enums_did(v in values()) {
            both_read_alike(&v.to_string())?;
        }
    }

    #[test]
    fn each_shape_reads_as_its_variant() -> Result<(), TestCaseError> {
        for text in [
            r#""hi""#,
            r#"["a", "b"]"#,
            "[]",
            "[1, 2, 4294967295]",
            "[[1], [], [2, 3]]",
            r#"[{"type": "text", "text": "x"}]"#,
            r#"[1, "a"]"#,
            "[4294967296]",
            "[-1]",
            "[[1], 2]",
            "7",
            "null",
            "{}",
        ] {
            both_read_alike(text)?;
        }
        let tokens: Prompt =
            serde_json::from_str("[5, 6]").map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(tokens, Prompt::Tokens(vec![5, 6]));
        Ok(())
    }
}
