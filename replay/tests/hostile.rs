//! Files a user downloads may be hostile, or broken: each of these fails with status 1 and a
//! message saying what is wrong, having read only what it had to. Every child's peak memory
//! is checked (the most of any child of this test binary, `getrusage(RUSAGE_CHILDREN)`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The most memory (resident) any run of the tool here may take: these inputs are small or
/// stop early, whatever they claim to hold.
const MAX_RSS_BYTES: i64 = 256 << 20;

fn file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Runs the tool on `args`; checks the peak memory of every child so far.
fn replay(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_gpupool-replay")).args(args).output().expect("the binary runs");
    // SAFETY: getrusage writes one struct rusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) }, 0);
    let rss = usage.ru_maxrss * 1024;
    assert!(rss <= MAX_RSS_BYTES, "a run of {args:?} took {} MiB", rss >> 20);
    out
}

/// Runs the tool on `path` (and `args`) and checks that it fails with status 1 saying `says`.
fn fails(path: &Path, args: &[&str], says: &[&str]) {
    let out = replay(&[args, &[path.to_str().unwrap()]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}: {err}", path.display());
    for s in says {
        assert!(err.contains(s), "{}: the message does not say {s:?}: {err}", path.display());
    }
    assert!(out.stdout.is_empty());
}

/// A pickle (protocol 4, no frames) of `body`, which leaves one object on the stack.
fn pickle(body: &[u8]) -> Vec<u8> {
    [&[0x80, 4], body, b"."].concat()
}

/// `SHORT_BINUNICODE`.
fn s(text: &str) -> Vec<u8> {
    [&[0x8c, text.len() as u8], text.as_bytes()].concat()
}

/// `BININT`.
fn int(n: i32) -> Vec<u8> {
    [&[b'J'][..], &n.to_le_bytes()].concat()
}

/// A list nested `depth` deep: `[[[...]]]`.
fn nested(depth: usize) -> Vec<u8> {
    [vec![b']'; depth], vec![b'a'; depth - 1]].concat()
}

/// A dict of `items` (keys and values, pickled) in `MARK ... SETITEMS`.
fn dict(items: &[Vec<u8>]) -> Vec<u8> {
    [&b"}("[..], &items.concat(), b"u"].concat()
}

/// A list of `items` in `MARK ... APPENDS`.
fn list(items: &[Vec<u8>]) -> Vec<u8> {
    [&b"]("[..], &items.concat(), b"e"].concat()
}

/// A snapshot of one alloc of 100 bytes, its `frames` being `frames`.
fn one_alloc(frames: Vec<u8>) -> Vec<u8> {
    let entry = dict(&[s("action"), s("alloc"), s("addr"), int(4096), s("size"), int(100), s("frames"), frames]);
    pickle(&dict(&[s("device_traces"), list(&[list(&[entry])])]))
}

#[test]
fn deep_nesting_is_read_without_recursion() {
    // 200,000 lists deep: the root, where a dict is expected.
    let path = file("deep-root.pickle", &pickle(&nested(200_000)));
    fails(
        &path,
        &[],
        &["not a PyTorch memory snapshot", "expected the dict of torch.cuda.memory._snapshot()", "found a list"],
    );
    // In a field that is read.
    let path = file("deep-segments.pickle", &pickle(&dict(&[s("segments"), nested(200_000)])));
    fails(&path, &[], &["segments[0] is a list, expected a dict"]);
    // In a field that is not read: the snapshot replays.
    let path = file("deep-frames.pickle", &one_alloc(nested(200_000)));
    let out = replay(&["--json", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["events"], 1);
    // And one that holds itself: `l = [] ; l.append(l)` as the frames.
    let path = file("recursive-frames.pickle", &one_alloc(b"]\x94h\x00a".to_vec()));
    let out = replay(&["--json", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn device_numbers_are_checked_not_counted_up_to() {
    let segment = |device: i64| {
        let block = dict(&[s("size"), int(512), s("requested_size"), int(100), s("state"), s("active_allocated")]);
        let device = [&[0x8a, 8][..], &device.to_le_bytes()].concat();
        dict(&[
            s("device"),
            device,
            s("address"),
            int(4096),
            s("total_size"),
            int(2 << 20),
            s("blocks"),
            list(&[block]),
        ])
    };
    let path = file("device-2-40.pickle", &pickle(&dict(&[s("segments"), list(&[segment(1 << 40)])])));
    fails(&path, &[], &["segments[0].device is 1099511627776, expected a device number"]);
    let path = file("device-minus-1.pickle", &pickle(&dict(&[s("segments"), list(&[segment(-1)])])));
    fails(&path, &[], &["segments[0].device is -1, expected an integer of 0 or more"]);
    // A large number that is one: only the devices present are visited.
    let path = file("device-2-30.pickle", &pickle(&dict(&[s("segments"), list(&[segment(1 << 30), segment(3)])])));
    let out = replay(&["--json", "--device", "1073741824", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["trace"], "device-2-30.pickle:device 1073741824");
    assert_eq!(rows[0]["initial_blocks"], 1);
    fails(&path, &["--device", "5"], &["device 5 has no trace entries", "devices with some: 3, 1073741824"]);
}

#[test]
fn what_is_not_a_snapshot_or_holds_nothing_is_refused() {
    let empty_list = file("empty-list.pickle", &pickle(b"]"));
    fails(&empty_list, &[], &["not a PyTorch memory snapshot", "with 'segments' and 'device_traces'", "found a list"]);
    let empty_dict = file("empty-dict.pickle", &pickle(b"}"));
    fails(&empty_dict, &[], &["found a dict without either"]);
    let nothing =
        file("nothing.pickle", &pickle(&dict(&[s("segments"), b"]".to_vec(), s("device_traces"), b"]".to_vec()])));
    fails(&nothing, &[], &["no trace entries and no live blocks: nothing to replay"]);
    let entry = dict(&[s("action"), int(7)]);
    let bad = file("bad-action.pickle", &pickle(&dict(&[s("device_traces"), list(&[list(&[entry])])])));
    fails(&bad, &[], &["device_traces[0][0].action is an integer, expected a string"]);
    let cut = file("cut.pickle", &one_alloc(b"]".to_vec())[..20]);
    fails(&cut, &[], &["the pickle ends early, at byte 20"]);
    let unknown = file("unknown-op.pickle", &pickle(b"\xff"));
    fails(&unknown, &[], &["not a valid pickle at byte 2: unknown opcode 0xff"]);
    let get = file("bad-get.pickle", &pickle(b"h\x07"));
    fails(&get, &[], &["memo 7 was never set"]);
    // A string that claims 2^40 bytes: skipped, not allocated, and found short.
    let long = file("long-string.pickle", &pickle(&[&[0x8d][..], &(1u64 << 40).to_le_bytes()].concat()));
    fails(&long, &[], &["the pickle ends early"]);
    let empty_text = file("empty.txt", b"\n# nothing\n\n");
    fails(&empty_text, &[], &["no events in it (3 lines): nothing to replay"]);
}

/// A gzip file of `copies` gzip members of `chunk` each: `copies * chunk.len()` bytes once
/// decompressed, for about `copies` kilobytes.
fn gzip_bomb(name: &str, chunk: &[u8], copies: usize) -> PathBuf {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(chunk).unwrap();
    let member = gz.finish().unwrap();
    file(name, &member.repeat(copies))
}

#[test]
fn a_gzip_bomb_is_streamed_and_stops_early() {
    // 1 GiB of spaces in 1 MB: one line, longer than any trace's.
    let spaces = gzip_bomb("spaces.txt.gz", &vec![b' '; 1 << 20], 1024);
    assert!(std::fs::metadata(&spaces).unwrap().len() < 2 << 20);
    fails(&spaces, &[], &["spaces.txt.gz:1: a line longer than 64 KiB: not a text trace"]);
    // Valid lines (frees of nothing), more of them than --max-input lets through.
    let frees = gzip_bomb("frees.txt.gz", &b"f 1\n".repeat(1 << 18), 128);
    fails(
        &frees,
        &["--max-input", "64MiB"],
        &["frees.txt.gz: more than 64 MiB once decompressed (--max-input raises the limit)"],
    );
    // A pickle of empty lists: each costs far more decoded than its byte.
    let lists = gzip_bomb("lists.pickle.gz", &[&[0x80, 4][..], &vec![b']'; 1 << 20]].concat(), 64);
    fails(
        &lists,
        &["--max-input", "16MiB"],
        &["takes more than 16 MiB of memory once decoded (--max-input raises the limit)"],
    );
    // The same file, not compressed.
    let raw = file("frees.txt", &b"f 1\n".repeat(1 << 10));
    fails(&raw, &["--max-input", "1KiB"], &["frees.txt: more than 1 KiB long"]);
}
