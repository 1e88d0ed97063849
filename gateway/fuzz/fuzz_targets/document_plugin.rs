#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmgate::fuzzing::document_plugin(data));
