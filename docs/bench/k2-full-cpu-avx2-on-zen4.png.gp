set terminal pngcairo size 900,560 font ',11'
set termoption noenhanced
set output 'docs/bench/k2-full-cpu-avx2-on-zen4.png'
set title 'Kimi K2 full layer, avx2 tier, zen4 host (forced on a host that runs avx512-bf16: a proxy run): time vs roofline (cpu(avx2, 2 threads))'
set logscale xy
set xlabel 'tokens per step'
set ylabel 'ms'
set grid
set key top left
plot 'docs/bench/k2-full-cpu-avx2-on-zen4.png.dat' u 1:2 w lp lw 2 pt 7 t 'measured (median)', 'docs/bench/k2-full-cpu-avx2-on-zen4.png.dat' u 1:3 w l lw 2 dt 2 t 'roofline max(bytes/BW, FLOPs/peak)', 'docs/bench/k2-full-cpu-avx2-on-zen4.png.dat' u 1:4 w l lw 1 dt 3 t 'weights / read BW', 'docs/bench/k2-full-cpu-avx2-on-zen4.png.dat' u 1:5 w l lw 1 dt 4 t 'FLOPs / compute peak'
