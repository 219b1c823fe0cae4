//! Two processes for the IPC tests: the test binary runs itself again as a consumer (the test
//! `consumer` below, which does nothing unless `GPUPOOL_IPC_CONSUMER` is set), which takes one
//! command a line on its stdin and answers one line on its stdout, prefixed `IPC `. The
//! consumer has its own allocator over its own simulated device (one process, one device, as
//! on a GPU). A binary whose tests start consumers declares this module at its root, as `ipc`,
//! beside `common`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;

use gpupool::driver::DriverError;
use gpupool::driver::sim::{SimDriver, SimOp};
use gpupool::{Allocator, IPC_HANDLE_SIZE, config::Config};

pub const ENV: &str = "GPUPOOL_IPC_CONSUMER";

/// The consumer process's entry point: nothing unless run as one.
#[test]
fn consumer() {
    if std::env::var_os(ENV).is_some() {
        serve();
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

pub fn handle_of(s: &str) -> [u8; IPC_HANDLE_SIZE] {
    unhex(s).try_into().unwrap()
}

/// The byte at `i` of a block filled with `seed`.
pub fn pattern(seed: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 8) as u8)
}

pub fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: simulated device memory is host memory of `len` bytes at `ptr`.
    let s = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    s.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(seed, i));
}

pub fn matches(ptr: u64, len: usize, seed: u8) -> bool {
    // SAFETY: as `fill`.
    let s = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    crate::common::holds_pattern(s, |i| pattern(seed, i))
}

/// This process's virtual memory size in KiB and its open descriptors.
pub fn footprint() -> (u64, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let vm = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    let kib = vm.split_whitespace().nth(1).unwrap().parse().unwrap();
    (kib, std::fs::read_dir("/proc/self/fd").unwrap().count())
}

/// A consumer process.
pub struct Consumer {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Consumer {
    pub fn start() -> Consumer {
        let consumer = crate::common::process::test_path(module_path!(), "consumer");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &consumer, "--nocapture", "--test-threads=1", "--quiet"])
            .env(ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Consumer { child, stdin, stdout }
    }

    /// Sends a command; returns the answer (without its prefix).
    pub fn ask(&mut self, line: &str) -> String {
        self.send(line);
        self.answer()
    }

    /// Sends a command without waiting for its answer.
    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The answer to the oldest command not yet answered.
    pub fn answer(&mut self) -> String {
        loop {
            let mut s = String::new();
            assert!(self.stdout.read_line(&mut s).unwrap() > 0, "the consumer ended");
            if let Some(a) = s.trim_end().strip_prefix("IPC ") {
                return a.to_string();
            }
        }
    }

    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn end(mut self) {
        assert_eq!(self.ask("exit"), "bye");
        assert!(self.child.wait().unwrap().success());
    }
}

fn parse(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

/// The consumer's loop: `import H`, `check P LEN SEED`, `fill P LEN SEED`, `close P`,
/// `cycle H LEN SEED` (import, check, close), `threads N H...` (N import-check-close cycles on
/// each handle, a thread each), `faults H LEN SEED` (an import and a close with a fault at
/// each of their driver calls, then a clean one), `export` (a block of its own, 1 MiB filled with seed 77, its handle answered), `peer D P`
/// (`enable_peer_access(D, P)`), `access D` (the devices granted at each mapped piece of device
/// D, `.`-joined, the pieces space-separated), `state`, `exit`,
/// `quit` (exits with imports open, nothing dropped).
pub fn serve() {
    let driver = Arc::new(SimDriver::new(2, 1 << 30));
    let alloc = Allocator::new(driver.clone(), Config::default());
    let reply = |s: String| {
        println!("IPC {s}");
        std::io::stdout().flush().unwrap();
    };
    let result = |r: Result<u64, gpupool::Error>| match r {
        Ok(p) => format!("ok {p:#x}"),
        Err(e) => format!("err {e}"),
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w[i].parse::<usize>().unwrap();
        match w[0] {
            "import" => reply(result(alloc.ipc_import(&handle_of(w[1]), num(2) as i32))),
            "check" => reply(if matches(parse(w[1]), num(2), num(3) as u8) { "ok".into() } else { "bad".into() }),
            "fill" => {
                fill(parse(w[1]), num(2), num(3) as u8);
                reply("ok".into())
            }
            "close" => reply(result(alloc.ipc_close(parse(w[1])).map(|()| 0))),
            "cycle" => {
                let r = alloc.ipc_import(&handle_of(w[1]), 0).and_then(|p| {
                    let good = matches(p, num(2), num(3) as u8);
                    alloc.ipc_close(p)?;
                    Ok(good as u64)
                });
                reply(result(r))
            }
            "threads" => {
                let n = num(1);
                let ok = std::thread::scope(|s| {
                    let hs: Vec<_> = w[2..]
                        .iter()
                        .map(|h| {
                            let (alloc, h) = (&alloc, handle_of(h));
                            s.spawn(move || {
                                (0..n).all(|_| alloc.ipc_import(&h, 0).and_then(|p| alloc.ipc_close(p)).is_ok())
                            })
                        })
                        .collect();
                    hs.into_iter().all(|h| h.join().unwrap())
                });
                reply(format!("{ok}"))
            }
            "export" => {
                let p = alloc.malloc(1 << 20, 0, 0).unwrap();
                fill(p, 1 << 20, 77);
                reply(hex(&alloc.ipc_export(p).unwrap()))
            }
            "peer" => reply(result(alloc.enable_peer_access(num(1) as i32, num(2) as i32).map(u64::from))),
            "access" => {
                let map = driver.access_map(num(1) as i32);
                let pieces: Vec<String> = map
                    .iter()
                    .map(|(_, _, to)| to.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("."))
                    .collect();
                reply(pieces.join(" "))
            }
            "faults" => reply(faults(&alloc, &driver, &handle_of(w[1]), num(2), num(3) as u8)),
            "state" => {
                let (kib, fds) = footprint();
                let vmm = driver.live_vmm();
                let opened = driver.opened_ipc_bytes();
                reply(format!("{} {kib} {fds} {} {} {opened}", alloc.ipc_import_count(), vmm.0, vmm.1))
            }
            "exit" => {
                reply("bye".into());
                return;
            }
            // Exits at once, imports left open and the allocator not dropped (as a C program
            // that returns from main without closing them).
            "quit" => {
                reply("bye".into());
                std::process::exit(0);
            }
            other => reply(format!("unknown {other}")),
        }
    }
}

/// A fault at each driver call of an import and of a close: each import fails and leaves
/// nothing mapped or reserved, each close fails and a second one succeeds. Answers `ok N`, N
/// the faults that fired.
fn faults(alloc: &Allocator, driver: &SimDriver, h: &[u8; IPC_HANDLE_SIZE], len: usize, seed: u8) -> String {
    let fail = || DriverError::Cuda { call: "test", code: 999, name: "CUDA_ERROR_UNKNOWN".into() };
    let baseline = driver.live_vmm();
    let mut count = 0;
    let ops = [
        SimOp::DeviceUuid,
        SimOp::AddressReserve,
        SimOp::MemImport,
        SimOp::MemMap,
        SimOp::MemSetAccess,
        SimOp::IpcOpenMemHandle,
    ];
    for op in ops {
        driver.inject_fault(op, 0, fail());
        let r = alloc.ipc_import(h, 0);
        let fired = driver.pending_faults() == 0;
        count += fired as usize;
        driver.clear_faults();
        match r {
            Ok(p) if fired => return format!("import succeeded with a fault at {op:?} ({p:#x})"),
            Ok(p) => alloc.ipc_close(p).unwrap(),
            Err(_) if driver.live_vmm() != baseline || alloc.ipc_import_count() != 0 => {
                return format!("a failed import at {op:?} left {:?}", driver.live_vmm());
            }
            Err(_) => {}
        }
    }
    for op in [SimOp::MemUnmap, SimOp::MemRelease, SimOp::AddressFree, SimOp::IpcCloseMemHandle] {
        let p = match alloc.ipc_import(h, 0) {
            Ok(p) => p,
            Err(e) => return format!("a clean import failed: {e}"),
        };
        driver.inject_fault(op, 0, fail());
        let first = alloc.ipc_close(p);
        let fired = driver.pending_faults() == 0;
        count += fired as usize;
        driver.clear_faults();
        if fired && first.is_ok() {
            return format!("a close succeeded with a fault at {op:?}");
        }
        // A refused first step leaves the memory mapped; a later one, not (reading it would fault).
        let first_step = matches!(op, SimOp::MemUnmap | SimOp::IpcCloseMemHandle);
        if fired && ((first_step && !matches(p, len, seed)) || alloc.ipc_close(p).is_err()) {
            return format!("after a failed close at {op:?} the import is not intact, or a second close failed");
        }
        if driver.live_vmm() != baseline || alloc.ipc_import_count() != 0 {
            return format!("after the close at {op:?}: {:?} {}", driver.live_vmm(), alloc.ipc_import_count());
        }
    }
    format!("ok {count}")
}
