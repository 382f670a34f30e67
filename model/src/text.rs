//! Text that users wrote (job names, argv, reasons, log lines, audit details), made safe to
//! print on an operator's terminal: a job whose argv holds terminal escapes must not rewrite
//! an admin's screen when `ctl status` or `trainyard-controller audit` shows it.

use std::borrow::Cow;

/// Whether `c` would act on a terminal or reorder what is shown rather than be shown: C0
/// controls other than newline and tab, DEL, C1 controls, and the bidirectional overrides and
/// isolates ("Trojan Source").
pub fn is_unsafe(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every unsafe character written as `\uXXXX`, which reads the same in plain text
/// and is a valid escape inside a JSON string. Borrowed when there is none (the usual case).
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_unsafe(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_overrides_are_shown_not_acted_on() {
        assert!(matches!(printable("plain line\n\tindented"), Cow::Borrowed(_)));
        assert_eq!(printable("\u{1b}[2J\u{1b}]0;pwned\u{7}x"), "\\u001b[2J\\u001b]0;pwned\\u0007x");
        assert_eq!(printable("a\u{9b}31mb\u{7f}"), "a\\u009b31mb\\u007f");
        assert_eq!(printable("evil\u{202e}txt.exe"), "evil\\u202etxt.exe");
        assert_eq!(printable("\r"), "\\u000d");
        // The result is valid inside a JSON string.
        let json = format!("\"{}\"", printable("\u{1b}[1m\u{9b}"));
        assert_eq!(serde_json::from_str::<String>(&json).unwrap(), "\u{1b}[1m\u{9b}");
    }
}
