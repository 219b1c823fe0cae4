//! The one rule on white space, for every `GPUPOOL_*` variable and `GPUPOOL_CONF` alike: the
//! ASCII space is the only blank a value may hold (around a value, before a size's unit, and
//! anywhere in `GPUPOOL_CONF`, whose tokenizer drops it as PyTorch's `ConfigTokenizer` does).
//! Every other white space (tab, newline, carriage return, no-break space, the Unicode spaces
//! and separators), every control character and the invisible characters that would show as
//! nothing is an error naming the character and its byte offset: read as a space, a tab or a
//! newline pasted from a file or a no-break space from a document would pass unseen, and
//! PyTorch itself reads a no-break space as part of a word (`std::stoull` then ignores it).

/// The first character of `text` that only the ASCII space may stand for, and its byte offset.
pub(crate) fn stray(text: &str) -> Option<(usize, char)> {
    text.char_indices().find(|&(_, c)| c != ' ' && (c.is_whitespace() || c.is_control() || invisible(c)))
}

/// Characters of no width and no glyph: zero width space, joiners, word joiner, byte order mark.
fn invisible(c: char) -> bool {
    matches!(c, '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}')
}

/// What [`stray`] found, for a message: `U+0009 (tab) at byte 4: only the ASCII space may
/// stand {where}`.
pub(crate) fn message((at, c): (usize, char), place: &str) -> String {
    let name = match c {
        '\t' => " (tab)",
        '\n' => " (line feed)",
        '\r' => " (carriage return)",
        '\u{A0}' => " (no-break space)",
        '\u{2028}' => " (line separator)",
        '\u{2029}' => " (paragraph separator)",
        '\u{200B}' => " (zero width space)",
        '\u{FEFF}' => " (byte order mark)",
        _ => "",
    };
    format!("U+{:04X}{name} at byte {at}: only the ASCII space may stand {place}", c as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_ascii_space_passes() {
        assert_eq!(stray(" a b  c "), None);
        assert_eq!(stray("ünïcödé ✓"), None);
        for (text, at) in [("a\tb", 1), ("\u{85}", 0), ("x\u{7f}", 1), ("ab\u{2009}", 2), ("é\u{2060}", 2)] {
            assert_eq!(stray(text).map(|(i, _)| i), Some(at), "{text:?}");
        }
        assert_eq!(message((3, '\t'), "here"), "U+0009 (tab) at byte 3: only the ASCII space may stand here");
    }
}
