//! A chat template rendered with each message's content as a short placeholder, the contents
//! put in their places after. A template that joins strings with `+` copies a message's content
//! once per join, so a long system prompt cost its render several copies of itself. Only for a
//! template that uses content as opaque text, as probe conversations show when it is loaded:
//! one that strips, splits, measures or tests content renders them otherwise.

const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// Below this many bytes of content in a conversation its joins cost less than a splice.
pub(crate) const SPLICE_FROM_BYTES: usize = 1024;

/// What message `i`'s content is rendered as (private-use characters around its index).
pub(crate) fn placeholder(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

/// `rendered` with each placeholder replaced by its message's content (contents are not
/// scanned, so one that holds a placeholder's text stays as it is); `None` where one is cut
/// short or names no message.
pub(crate) fn splice(rendered: &str, contents: &[&str]) -> Option<String> {
    let total: usize = contents.iter().map(|c| c.len()).sum();
    let mut out = String::with_capacity(rendered.len() + total);
    let mut rest = rendered;
    while let Some(at) = rest.find(OPEN) {
        out.push_str(&rest[..at]);
        let after = &rest[at + OPEN.len_utf8()..];
        let end = after.find(CLOSE)?;
        let i: usize = after[..end].parse().ok()?;
        out.push_str(contents.get(i)?);
        rest = &after[end + CLOSE.len_utf8()..];
    }
    out.push_str(rest);
    Some(out)
}

/// Conversations whose contents a template that transforms or tests content renders otherwise
/// than a placeholder: padded with whitespace and newlines, empty, a question, upper case,
/// with reasoning, tool-call and instruction tags.
pub(crate) const PROBES: &[&[(&str, &str)]] = &[
    &[
        ("system", " You are a helpful assistant.\n"),
        ("user", "Hello <think>x</think> there?  "),
        ("assistant", "<think>\nreasoning\n</think>\n\nThe answer."),
        ("user", ""),
    ],
    &[("user", "q")],
    &[
        ("user", "  \n"),
        (
            "assistant",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        ),
        ("tool", "<tool_response>\nok\n</tool_response>"),
        ("user", "FINAL ANSWER?"),
    ],
    &[
        ("system", ""),
        (
            "user",
            "[INST] a b c d e f g h i j k l m n o p q r s t u v w x y z [/INST]",
        ),
    ],
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_replaced_by_their_contents_wherever_and_however_often_they_appear() {
        let contents = ["first", "", "thé third"];
        let rendered = format!(
            "<a>{}</a><b>{}</b>{}{}!",
            placeholder(0),
            placeholder(1),
            placeholder(2),
            placeholder(2)
        );
        assert_eq!(
            splice(&rendered, &contents).unwrap(),
            "<a>first</a><b></b>thé thirdthé third!"
        );
        assert_eq!(
            splice("no placeholder", &contents).unwrap(),
            "no placeholder"
        );
    }

    #[test]
    fn a_cut_or_unknown_placeholder_is_no_splice() {
        let contents = ["x"];
        assert_eq!(splice(&format!("{OPEN}0"), &contents), None);
        assert_eq!(splice(&placeholder(1), &contents), None);
        assert_eq!(splice(&format!("{OPEN}zero{CLOSE}"), &contents), None);
    }
}
