//! The text format of the traces in `replay/traces`.

use gpupool_replay::Event::{Alloc, Free};
use gpupool_replay::input::load_bytes;
use gpupool_replay::text::parse_text;

#[test]
fn events_streams_and_ids_are_numbered_in_order() {
    let text = "\
# comment, then a blank line

a 7 4096 0
a 9 100 94371840
f 7
a 3 512 94371840
f 9
f 3
";
    let t = parse_text("t", text).unwrap();
    assert_eq!(t.name, "t");
    assert_eq!(t.streams, vec![0, 94371840]);
    assert_eq!(t.blocks, 3);
    assert_eq!(
        t.events,
        vec![
            Alloc { id: 0, size: 4096, stream: 0 },
            Alloc { id: 1, size: 100, stream: 1 },
            Free { id: 0 },
            Alloc { id: 2, size: 512, stream: 1 },
            Free { id: 1 },
            Free { id: 2 },
        ]
    );
    assert_eq!(t.allocations(), 3);
    assert_eq!(t.peak_live(), 4196);
    assert_eq!(t.initial_blocks, 0);
    assert!(t.notes.is_empty(), "{:?}", t.notes);
    assert!(t.recorded.is_none());
}

#[test]
fn unknown_frees_and_reused_ids_are_repaired_and_noted() {
    let t = parse_text("t", "a 1 10 0\nf 2\na 1 20 0\nf 1\nf 1\n").unwrap();
    assert_eq!(
        t.events,
        vec![
            Alloc { id: 0, size: 10, stream: 0 },
            Free { id: 0 },
            Alloc { id: 1, size: 20, stream: 0 },
            Free { id: 1 }
        ]
    );
    assert_eq!(t.peak_live(), 20);
    assert_eq!(
        t.notes,
        vec![
            "1 allocations of an ID still alive: the older block was freed first".to_string(),
            "2 frees of an ID not alive were skipped".to_string(),
        ]
    );
}

#[test]
fn a_bad_line_is_named() {
    let e = parse_text("x.txt", "a 1 10 0\na 2 ten 0\n").unwrap_err();
    assert!(e.starts_with("x.txt:2: \"ten\" is not a number"), "{e}");
    let e = parse_text("x.txt", "a 1 10 0\n\nfree 1\n").unwrap_err();
    assert!(e.starts_with("x.txt:3: not an event"), "{e}");
    assert!(e.contains("'a ID SIZE STREAM' or 'f ID'"), "{e}");
}

#[test]
fn gzip_and_binary_are_told_from_the_content() {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b"a 1 10 0\nf 1\n").unwrap();
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("text-test.txt.gz");
    std::fs::write(&path, gz.finish().unwrap()).unwrap();
    let traces = gpupool_replay::input::load(&path, None).unwrap();
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0].name, "text-test.txt.gz");
    assert_eq!(traces[0].events.len(), 2);
    let e = load_bytes("b", &[0xff, 0xfe, 0], None).unwrap_err();
    assert!(e.contains("neither a text trace"), "{e}");
}
