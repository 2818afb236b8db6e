fn main() {
    let w = clrbpf::bpf::system::prepare().expect("prepare");
    eprintln!("warnings: {w:?}");
    let mut s = clrbpf::bpf::Sampler::start(&Default::default()).unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(std::time::Duration::from_secs(2));
    let mut out = Vec::new();
    let bad = s.drain(&mut out);
    eprintln!(
        "samples {} bad {bad} counters {:?} stats {:?}",
        out.len(),
        s.counters(),
        s.on_cpu_program_stats()
    );
    for x in out.iter().take(3) {
        eprintln!(
            "{} {} {} k{} u{} {:x?}",
            x.pid,
            x.tid,
            x.thread_name,
            x.kernel_stack.len(),
            x.user_stack.len(),
            &x.user_stack[..x.user_stack.len().min(4)]
        );
    }
}
