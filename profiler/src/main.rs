fn main() {
    let _ = clrbpf::profile::Profile::default();
    let obj = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/clrbpf"));
    println!("{}", obj.len());
}
