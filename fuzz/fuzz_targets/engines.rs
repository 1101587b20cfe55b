//! vlmcontext's `engines` string (`NAME[:cpu|gpu[:THREADS[:CORES]]]` or
//! `NAME:rpc:HOST:PORT[+HOST:PORT...]`, comma separated), parsed
//! by runtime/src/engine_spec.rs (included as it is, without llama.cpp). Must never panic or
//! allocate without bound; what it accepts must be valid and must read back the same when
//! written out again.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../runtime/src/engine_spec.rs"]
mod engine_spec;

use engine_spec::{EngineSpec, MAX_CORES, MAX_RPC_SERVERS, MAX_THREADS, SpecDevice, parse_list};

fn write(specs: &[EngineSpec]) -> String {
    specs
        .iter()
        .map(|e| {
            let mut s = match &e.device {
                SpecDevice::Cpu => format!("{}:cpu", e.name),
                SpecDevice::Gpu => format!("{}:gpu", e.name),
                SpecDevice::Rpc(endpoints) => return format!("{}:rpc:{}", e.name, endpoints.join("+")),
            };
            if e.threads.is_some() || !e.cores.is_empty() {
                // A core list needs a thread count before it.
                s += &format!(":{}", e.threads.unwrap_or(1));
            }
            if !e.cores.is_empty() {
                s += ":";
                s += &e.cores.iter().map(usize::to_string).collect::<Vec<_>>().join("+");
            }
            s
        })
        .collect::<Vec<_>>()
        .join(",")
}

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = std::str::from_utf8(data) else { return };
    match parse_list(spec) {
        Err(why) => assert!(!why.is_empty()),
        Ok(specs) => {
            assert!(!specs.is_empty());
            for (i, e) in specs.iter().enumerate() {
                assert!(!e.name.is_empty() && e.name != "auto");
                assert!(e.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'));
                assert!(specs[..i].iter().all(|o| o.name != e.name), "duplicate {}", e.name);
                assert!(e.threads.is_none_or(|t| (1..=MAX_THREADS).contains(&t)));
                assert!(e.cores.iter().all(|&c| c < MAX_CORES));
                if let SpecDevice::Rpc(endpoints) = &e.device {
                    assert!((1..=MAX_RPC_SERVERS).contains(&endpoints.len()));
                    assert!(endpoints.iter().all(|p| p.split_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))));
                }
            }
            let again = parse_list(&write(&specs)).expect("a written list parses");
            let fill = |v: Vec<EngineSpec>| {
                v.into_iter()
                    .map(|e| EngineSpec { threads: e.threads.or((!e.cores.is_empty()).then_some(1)), ..e })
                    .collect::<Vec<_>>()
            };
            assert_eq!(fill(again), fill(specs));
        }
    }
});
